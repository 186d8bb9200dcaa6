"""launch.py's options: every one of them, their checks, the run's `LaunchConfig` built from
them, and their table in docs/reference.md. `pipec run` checks its arguments with the same
parser, before any rank starts.

`--config FILE.toml` holds launch options as keys: each option's name without the dashes,
`max_norm` or `max-norm` alike (the parser's own destinations, so every option is covered,
also those added later). Its values go in front of the command line, so a flag given there
overrides the file, and the parser checks them as it checks flags: a TOML value is what one
would type (a number, a string, true for a switch, an array for a comma-separated list).
An unknown key, a file that is not TOML, or any bad value is refused in one line, exit 2,
before any rank starts.

Each option's destination is a field of one section of runtime/config.py's `LaunchConfig`
(tests/test_train_cli.py holds that every one is, once).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import NoReturn

import torch

from pipec.frontend.precision import PRECISIONS
from pipec.markdown import cell
from pipec.runtime.config import SECTIONS, LaunchConfig
from pipec.runtime.faults import DEFAULT_TIMEOUT_S
from pipec.runtime.lr import DECAYS
from pipec.runtime.optim import IMPLEMENTATIONS, OPTIMIZERS

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


def _betas(text: str) -> tuple[float, float]:
    try:
        b1, b2 = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not two numbers; give beta1,beta2 such as 0.9,0.95"
        ) from None
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise argparse.ArgumentTypeError(f"{text!r}: each beta must be in [0, 1), e.g. 0.9,0.95")
    return b1, b2


def launch_parser() -> argparse.ArgumentParser:
    """Every option of launch.py (`--config` files take the same, by their destinations), in
    the order of launch.py --help and docs/reference.md."""
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
    ap.add_argument(
        "--seed", type=int, default=0, help="seed of the synthetic batches and of dropout's masks"
    )
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
    _add_metrics_options(ap)
    _add_training_options(ap)
    return ap


def _add_metrics_options(ap: argparse.ArgumentParser) -> None:
    """The options of the config file, metrics and evaluation."""
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


def _add_training_options(ap: argparse.ArgumentParser) -> None:
    """The options of docs/training.md's Precision, Clipping, Learning-rate schedule,
    Optimizer, ZeRO-1 and Non-finite sections."""
    ap.add_argument(
        "--precision",
        choices=tuple(PRECISIONS),
        default="fp32",
        help="bf16: bf16 compute, stashes and messages; fp32 master weights, gradients and "
        "optimizer state (default fp32)",
    )
    ap.add_argument(
        "--max-norm", type=float, help="clip the global gradient norm to this (default: none)"
    )
    ap.add_argument("--warmup", type=int, default=0, help="linear warm-up steps (default 0)")
    ap.add_argument("--decay", choices=DECAYS, default="none", help="after warm-up (default none)")
    ap.add_argument("--min-lr", type=float, default=0.0, help="where decay ends (default 0)")
    ap.add_argument(
        "--decay-fraction",
        type=float,
        default=0.2,
        help="wsd: the last fraction of the steps that decay (default 0.2)",
    )
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="(default adamw)")
    ap.add_argument(
        "--optimizer-impl",
        choices=IMPLEMENTATIONS,
        default="foreach",
        help="foreach: torch's default step's numbers; fused: one kernel, faster, rounds "
        "differently (default foreach)",
    )
    ap.add_argument(
        "--betas", type=_betas, default=(0.9, 0.999), help="AdamW's, as 0.9,0.95 (0.9,0.999)"
    )
    ap.add_argument("--eps", type=float, default=1e-8, help="AdamW's epsilon (default 1e-8)")
    ap.add_argument(
        "--weight-decay",
        type=float,
        default=0.0,
        help="decoupled weight decay of parameters of 2+ dimensions (default 0)",
    )
    ap.add_argument(
        "--zero",
        type=int,
        choices=(0, 1),
        default=0,
        help="1: shard master weights and optimizer state over the data-parallel copies",
    )
    ap.add_argument(
        "--skip-nonfinite",
        action="store_true",
        help="skip a step whose loss or gradient norm is not finite (default: stop, exit 3)",
    )


def parse_launch(argv: Sequence[str] | None) -> LaunchConfig:
    """launch.py's options (`argv`, None: the command line's) with --config's before them,
    checked (a refusal: one line, exit 2), as the run's config; `pipec run` checks its
    arguments with it too."""
    ap = launch_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--config", type=directory)
    found, _ = first.parse_known_args(argv)
    if found.config is not None:
        argv = config_argv(ap, found.config) + argv
    config = _config(ap.parse_args(argv))
    if error := _error(config):
        ap.error(error)
    return config


def _error(config: LaunchConfig) -> str | None:
    """What is wrong with values the parser cannot judge alone, in one line (None: nothing)."""
    run, t, ck, metrics, ev = (
        config.run, config.training, config.checkpoint, config.metrics, config.eval
    )  # fmt: skip
    if metrics.peak_tflops is not None and metrics.peak_tflops <= 0:
        return f"--peak-tflops must be positive (got {metrics.peak_tflops:g})"
    if ev.eval_every < 0 or ev.eval_steps < 1:
        return "--eval-every must be 0 (never) or more, --eval-steps at least 1"
    if metrics.tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
        return (
            "--tensorboard needs the tensorboard package: pip install 'pipec[tensorboard]' "
            "(or pip install tensorboard)"
        )
    if t.steps < 1 or run.timeout <= 0 or ck.save_every < 0:
        return "--steps must be at least 1, --timeout positive, --save-every 0 or more"
    if run.check_grads and ck.save:
        return "--check-grads runs one step and saves nothing; drop --save"
    if t.max_norm is not None and not t.max_norm > 0:
        return f"--max-norm {t.max_norm:g}: the norm to clip to must be positive"
    if t.warmup < 0 or t.warmup >= t.steps:
        return (
            f"--warmup {t.warmup} with --steps {t.steps}: warm-up must be 0 or more and "
            "fewer steps than the run"
        )
    if t.lr <= 0 or not 0 <= t.min_lr <= t.lr:
        return f"--lr {t.lr:g} must be positive and --min-lr {t.min_lr:g} in [0, lr]"
    if not 0 < t.decay_fraction <= 1:
        return f"--decay-fraction {t.decay_fraction:g} must be in (0, 1]"
    if t.eps <= 0 or t.weight_decay < 0:
        return "--eps must be positive and --weight-decay 0 or more"
    if run.check_grads and t.precision != "fp32":
        return "--check-grads compares fp32 gradients with the plain model's; drop --precision"
    return None


def _config(args: argparse.Namespace) -> LaunchConfig:
    """The parsed options as the run's config, each in its section; the one place a namespace
    is read. The backend is resolved here: NCCL with CUDA (one GPU per rank), else gloo, and
    gloo with --share-gpu."""
    cuda = torch.cuda.is_available() and not args.share_gpu
    values = vars(args) | {"backend": args.backend or ("nccl" if cuda else "gloo")}
    return LaunchConfig(
        **{
            name: section(**{f.name: values[f.name] for f in fields(section)})
            for name, section in SECTIONS.items()
        }
    )


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


def _options(ap: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's options in their order, its help left out (argparse has no public list)."""
    return [a for a in ap._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def changed(config: LaunchConfig) -> str:
    """The options that differ from launch.py's defaults, as `key=value …` (start-up line)."""
    ap, values = launch_parser(), config.to_json()
    diff = {
        a.dest: values[a.dest]
        for a in _options(ap)
        if a.dest != "config" and values[a.dest] != a.default
    }
    return " ".join(f"{k}={v}" for k, v in diff.items()) or "launch.py's defaults"


def reference_markdown() -> str:
    """launch.py's options as docs/reference.md's table (`pipec run BUILD` passes the same
    through)."""
    rows = ["| option | what | default |", "|---|---|---|"]
    for action in _options(launch_parser()):
        names = ", ".join(action.option_strings)
        if action.nargs != 0:
            names += f" {action.metavar or action.dest.upper()}"
        if action.choices:
            names += " (" + "\\|".join(map(str, action.choices)) + ")"
        default = action.default
        unset = default is None or default is False or default == argparse.SUPPRESS
        shown = "" if unset else f"`{default}`"
        rows.append(f"| `{names}` | {cell(action.help or '')} | {shown} |")
    return "\n".join(rows) + "\n"
