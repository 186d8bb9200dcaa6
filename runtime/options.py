"""launch.py's options and their parser, which `pipec run` also checks its arguments with.

`--config FILE.toml` holds launch options as keys: each option's name without the dashes,
`max_norm` or `max-norm` alike (the parser's own destinations, so every option is covered,
also those added later). Its values go in front of the command line, so a flag given there
overrides the file, and the parser checks them as it checks flags: a TOML value is what one
would type (a number, a string, true for a switch, an array for a comma-separated list).
An unknown key, a file that is not TOML, or any bad value is refused in one line, exit 2,
before any rank starts (`pipec run` parses the options up front with the same parser).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from pipec.runtime.faults import DEFAULT_TIMEOUT_S
from pipec.runtime.train_options import add_training_options, training_error

DESCRIPTION = "The runtime's entry point: what OUT/launch.py runs on every rank under torchrun."

#: Options that are not keys of a config file: the file itself, and launch.py's help.
NOT_KEYS = frozenset({"config", "help"})


class LaunchParser(argparse.ArgumentParser):
    """argparse whose refusals are one line (no usage block) and exit 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} ({self.prog} --help lists them)\n")
        sys.exit(2)


def directory(text: str) -> Path | None:
    """A path option's value; an empty one turns the option off, as if not given (how a flag
    cancels a --config file's value: `--save ""`)."""
    return Path(text) if text else None


def add_options(ap: argparse.ArgumentParser) -> None:
    """The options of metrics, evaluation and the config file."""
    ap.add_argument(
        "--config",
        type=directory,
        help="launch options from a TOML file (keys: the options' names, e.g. steps = 100, "
        "max_norm = 1.0); flags given here override it",
    )
    ap.add_argument(
        "--peak-tflops",
        type=float,
        help="peak TFLOP/s of one device, for MFU (default: the table of known GPUs; "
        "no MFU on a CPU or an unknown GPU)",
    )
    ap.add_argument(
        "--tensorboard",
        type=directory,
        metavar="DIR",
        help="also write the metrics to TensorBoard event files in DIR "
        "(pip install 'pipec[tensorboard]')",
    )
    ap.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="K",
        help="evaluate on ModelSpec.eval_data after every K steps (default 0: never)",
    )
    ap.add_argument(
        "--eval-steps",
        type=int,
        default=10,
        metavar="N",
        help="batches per evaluation, from eval_data's first (default 10)",
    )


def parse(ap: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`ap.parse_args` with --config's options before the command line's; then the checks of
    this module's options."""
    argv = list(sys.argv[1:] if argv is None else argv)
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--config", type=directory)
    found, _ = first.parse_known_args(argv)
    if found.config is not None:
        argv = config_argv(ap, found.config) + argv
    args = ap.parse_args(argv)
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        ap.error(f"--peak-tflops must be positive (got {args.peak_tflops:g})")
    if args.eval_every < 0 or args.eval_steps < 1:
        ap.error("--eval-every must be 0 (never) or more, --eval-steps at least 1")
    if args.tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
        ap.error(
            "--tensorboard needs the tensorboard package: pip install 'pipec[tensorboard]' "
            "(or pip install tensorboard)"
        )
    return args


def _load_toml(path: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10: the tomli backport, a dependency there
        import tomli as tomllib
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ValueError(f"cannot read it ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"not TOML: {e}") from None


def config_argv(ap: argparse.ArgumentParser, path: Path) -> list[str]:
    """The command-line form of the options in TOML file `path`; refuses (ap.error) a file
    that cannot be read, an unknown key or a value of the wrong kind."""
    try:
        table = _load_toml(path)
    except ValueError as e:
        ap.error(f"--config {path}: {e}")
    actions = {a.dest: a for a in ap._actions if a.dest not in NOT_KEYS}
    argv: list[str] = []
    for key, value in table.items():
        action = actions.get(key.replace("-", "_"))
        if action is None:
            ap.error(
                f"--config {path}: unknown key {key!r}; valid keys: {', '.join(sorted(actions))}"
            )
        flag = next(s for s in action.option_strings if s.startswith("--"))
        if action.nargs == 0:  # a switch
            if not isinstance(value, bool):
                ap.error(f"--config {path}: {key} is a switch; write {key} = true or false")
            argv += [flag] if value else []
        elif isinstance(value, bool | dict):
            ap.error(f"--config {path}: {key} takes a value as {flag} does, got {value!r}")
        elif isinstance(value, list):
            argv += [flag, ",".join(map(str, value))]
        else:
            argv += [flag, str(value)]
    return argv


def effective(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """Every option's value in this run, JSON-ready (paths as strings), by key."""
    out = {}
    for a in ap._actions:  # argparse's list of options (no public accessor)
        if a.dest != "help":
            value = getattr(args, a.dest, None)
            out[a.dest] = str(value) if isinstance(value, Path) else value
    return out


def changed(ap: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The options that differ from launch.py's defaults, as `key=value …` (start-up line)."""
    values = effective(ap, args)
    diff = {k: v for k, v in values.items() if v != ap.get_default(k) and k != "config"}
    return " ".join(f"{k}={v}" for k, v in diff.items()) or "launch.py's defaults"


def parse_launch(argv: Sequence[str] | None) -> argparse.Namespace:
    """launch.py's options, checked (a refusal: one line, exit 2); `pipec run` checks its
    arguments with it too."""
    ap = launch_parser()
    args = parse(ap, argv)
    if args.steps < 1 or args.timeout <= 0 or args.save_every < 0:
        ap.error("--steps must be at least 1, --timeout positive, --save-every 0 or more")
    if args.check_grads and args.save:
        ap.error("--check-grads runs one step and saves nothing; drop --save")
    if error := training_error(args):
        ap.error(error)
    return args


def launch_parser() -> argparse.ArgumentParser:
    """Every option of launch.py (`--config` files take the same, by their destinations)."""
    ap = LaunchParser(prog="launch.py", description=DESCRIPTION)
    ap.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    ap.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds one instruction may wait before the run is called hung "
        f"({DEFAULT_TIMEOUT_S:g})",
    )
    ap.add_argument(
        "--model", default=None, help="factory spec, if not the plan's (e.g. moved file)"
    )
    ap.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="default: nccl with CUDA (gloo with --share-gpu), else gloo",
    )
    ap.add_argument(
        "--share-gpu",
        action="store_true",
        help="the ranks of a node share its GPUs (all of them one GPU on a one-GPU machine): "
        "gloo, messages through page-locked host memory",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank (default: cores / local ranks)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic micro-batches")
    ap.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the medians")
    ap.add_argument(
        "--save", type=directory, help='write checkpoints to DIR (at the end at least; "": off)'
    )
    ap.add_argument("--save-every", type=int, default=0, help="and every K steps (default: 0)")
    ap.add_argument(
        "--resume",
        type=directory,
        help="continue from a checkpoint: DIR's newest, or DIR/step_N",
    )
    ap.add_argument(
        "--check-grads",
        action="store_true",
        help="one step; compare each stage's gradients with the plain model's; exit 1 if not equal",
    )
    ap.add_argument(
        "--no-verify", action="store_true", help="skip `pipec verify`'s checks (huge builds)"
    )
    add_options(ap)
    add_training_options(ap)
    return ap
