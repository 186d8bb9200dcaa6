"""`pipec`: compile, simulate, show and verify pipeline schedules (the commands live in
pipec/commands/, a module per kind of work; this is the group, its entry point and the one place
that turns every user error into one line and exit code 2, never a traceback)."""

from __future__ import annotations

import atexit
import os
import signal
import sys
from typing import NoReturn

import click

from pipec import __version__
from pipec.build_dir import os_error
from pipec.commands.builds import export, run_cmd, show, verify_cmd
from pipec.commands.compiling import compile_cmd, simulate_cmd
from pipec.commands.planning import plan_cmd
from pipec.compile import gc_paused
from pipec.ir import PipecError
from pipec.passes.registry import SCHEDULES, family
from pipec.terminal import printable


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="pipec", message="%(prog)s %(version)s")
def cli() -> None:
    """pipec: compile pipeline-parallel schedules into verified, simulated per-rank programs."""


@cli.command()
def schedules() -> None:
    """List the schedule families with their parameters."""
    family("1f1b")  # registers the built-in families
    for name in sorted(SCHEDULES):
        fam = SCHEDULES[name]
        click.echo(f"{name:<14} v {fam.chunks:<5} {fam.summary}")


for command in (compile_cmd, simulate_cmd, show, verify_cmd, plan_cmd, run_cmd, export):
    cli.add_command(command)


def main(argv: list[str] | None = None) -> object:
    """Run the CLI, turning every user error into one line and exit code 2; returns what the
    command returned (`compile`: its CompileResult)."""
    try:
        return cli.main(args=argv, prog_name="pipec", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("pipec: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:  # a UsageError too
        _refuse(e.format_message())
    except PipecError as e:
        _refuse(str(e))
    except OSError as e:
        _refuse(os_error(e))


def _refuse(message: str) -> NoReturn:
    """Say `message` in one line (its paths as typed, control characters escaped), exit 2."""
    click.echo(f"pipec: error: {printable(message)}", err=True)
    sys.exit(2)


def _terminated(signum: int, frame: object) -> NoReturn:
    click.echo("pipec: terminated", err=True)
    sys.exit(128 + signum)


def run() -> NoReturn:
    """The `pipec` command: `main()` with the collector paused, then an exit that leaves the
    heap to the operating system.

    A large compile holds 10^6 objects when its files are written. Freeing them one by one,
    the collector's scan of them and the interpreter's shutdown took another 1.0-1.5 s of a
    4.8 s `pipec compile` at p=64, m=1024. Exit handlers still run; open files are flushed.
    SIGTERM exits as an exception would (status 143), so a half-written build is removed.
    """
    signal.signal(signal.SIGTERM, _terminated)
    with gc_paused():
        try:
            kept = main()  # noqa: F841 - held, not freed, until the process ends
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
