"""`launch.py`'s training options: precision, clipping, schedule, optimizer, ZeRO, the guard.

`add_training_options` adds them to launch.py's parser, `training_error` is the one-line
verdict on values the parser cannot judge alone (`pipec run` parses with the same parser before
any rank starts), and `train_options` turns them into runtime/optim.py's `TrainOptions`.
`--zero 1` also needs a build with data parallelism, which launch.py's preflight checks.
"""

from __future__ import annotations

import argparse

from pipec.frontend.precision import PRECISIONS
from pipec.runtime.lr import DECAYS, Schedule
from pipec.runtime.optim import IMPLEMENTATIONS, OPTIMIZERS, TrainOptions


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


def add_training_options(ap: argparse.ArgumentParser) -> None:
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


def training_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the training options, in one line (None: nothing)."""
    if args.max_norm is not None and not args.max_norm > 0:
        return f"--max-norm {args.max_norm:g}: the norm to clip to must be positive"
    if args.warmup < 0 or args.warmup >= args.steps:
        return (
            f"--warmup {args.warmup} with --steps {args.steps}: warm-up must be 0 or more and "
            "fewer steps than the run"
        )
    if args.lr <= 0 or not 0 <= args.min_lr <= args.lr:
        return f"--lr {args.lr:g} must be positive and --min-lr {args.min_lr:g} in [0, lr]"
    if not 0 < args.decay_fraction <= 1:
        return f"--decay-fraction {args.decay_fraction:g} must be in (0, 1]"
    if args.eps <= 0 or args.weight_decay < 0:
        return "--eps must be positive and --weight-decay 0 or more"
    if args.check_grads and args.precision != "fp32":
        return "--check-grads compares fp32 gradients with the plain model's; drop --precision"
    return None


def train_options(args: argparse.Namespace) -> TrainOptions:
    """The parsed options as the Trainer takes them."""
    schedule = Schedule(
        args.lr, args.steps, args.warmup, args.decay, args.min_lr, args.decay_fraction
    )
    return TrainOptions(
        schedule,
        args.optimizer,
        args.optimizer_impl,
        args.betas,
        args.eps,
        args.weight_decay,
        args.precision,
        args.max_norm,
        bool(args.zero),
        args.skip_nonfinite,
    )


def zero_error(args: argparse.Namespace, dp: int) -> str | None:
    """`--zero 1` on a build of `dp` data-parallel copies: None when it can shard, else why."""
    if args.zero and dp < 2:
        return (
            "--zero 1 shards the optimizer over data-parallel copies, and this build has one; "
            "compile with --dp 2 or more, or drop --zero"
        )
    return None
