"""docs/reference.md, generated from the parsers themselves, so it cannot drift from them: every
`pipec` command with its arguments and options (click), then every option of a build's
launch.py and of `pipec run` after the build (argparse, runtime/options.py).

    python -m pipec.reference docs/reference.md     # rewrite it; tests/test_docs.py checks it
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import click

HEADER = """# Reference: commands and launch options

Generated from pipec's own parsers by `python -m pipec.reference docs/reference.md`; a test
fails when this page and the parsers differ. `pipec COMMAND -h` prints the same.
"""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _click_option(param: click.Parameter, ctx: click.Context) -> tuple[str, str, str]:
    names, _ = param.get_help_record(ctx) or (param.human_readable_name, "")
    help_text = getattr(param, "help", None) or ""
    default = param.get_default(ctx, call=False)
    unset = default is None or default is getattr(click.core, "UNSET", None) or default == ()
    hidden = unset or callable(default) or getattr(param, "is_flag", False)
    return f"`{_cell(names)}`", _cell(help_text), "" if hidden else f"`{default}`"


def commands_markdown(group: click.Group) -> str:
    """A section per command: its usage line, its help and its options as a table."""
    parts = []
    for name in sorted(group.commands):
        cmd = group.commands[name]
        ctx = click.Context(cmd, info_name=f"pipec {name}")
        usage = " ".join(cmd.collect_usage_pieces(ctx))
        parts.append(f"### pipec {name}\n\n```text\npipec {name} {usage}\n```\n")
        parts.append((cmd.help or "").strip() + "\n")
        options = [
            p for p in cmd.get_params(ctx) if isinstance(p, click.Option) and "--help" not in p.opts
        ]
        if options:
            rows = ["| option | what | default |", "|---|---|---|"]
            rows += ["| {} | {} | {} |".format(*_click_option(p, ctx)) for p in options]
            parts.append("\n".join(rows) + "\n")
    return "\n".join(parts)


def launch_markdown(parser: argparse.ArgumentParser) -> str:
    """launch.py's options as a table (`pipec run BUILD` passes the same through)."""
    rows = ["| option | what | default |", "|---|---|---|"]
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        names = ", ".join(action.option_strings)
        if action.nargs != 0:
            names += f" {action.metavar or action.dest.upper()}"
        if action.choices:
            names += " (" + "\\|".join(map(str, action.choices)) + ")"
        default = action.default
        unset = default is None or default is False or default == argparse.SUPPRESS
        shown = "" if unset else f"`{default}`"
        rows.append(f"| `{names}` | {_cell(action.help or '')} | {shown} |")
    return "\n".join(rows) + "\n"


def render() -> str:
    from pipec.cli import cli
    from pipec.runtime.options import launch_parser

    return (
        f"{HEADER}\n## Commands\n\n{commands_markdown(cli)}\n"
        "## Launch options\n\n"
        "What `BUILD/launch.py` takes under torchrun, and `pipec run BUILD` after the build; a "
        "`--config FILE.toml` file takes the same names as keys.\n\n"
        f"{launch_markdown(launch_parser())}"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(render())
    else:
        print(render(), end="")
