"""One run's launch configuration: launch.py's options, checked, as a frozen value in sections.

runtime/options.py defines the options and builds a `LaunchConfig` once, from launch.py's
command line, a `--config FILE.toml` and `pipec run`'s arguments alike; everything after takes
the config, or the section it needs. A field is named as its option's destination (`--save-every`
is `checkpoint.save_every`), so an option, its TOML key, its field and its key in
measured/config.json are one word.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import get_type_hints

from pipec.runtime.lr import Schedule
from pipec.runtime.optim import TrainOptions


@dataclass(frozen=True)
class RunConfig:
    """How the ranks start: the model's factory if moved, the backend (resolved: never None),
    GPUs shared, torch threads per rank, the hang timeout, the build's verification, a
    gradient check instead of training, and the TOML file the options came from."""

    model: str | None
    backend: str
    share_gpu: bool
    threads: int | None
    timeout: float
    no_verify: bool
    check_grads: bool
    config: Path | None


@dataclass(frozen=True)
class TrainingConfig:
    """What the steps do: how many, the data's seed, precision and the optimizer's options."""

    steps: int
    lr: float
    seed: int
    precision: str
    max_norm: float | None
    warmup: int
    decay: str
    min_lr: float
    decay_fraction: float
    optimizer: str
    optimizer_impl: str
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    zero: int
    skip_nonfinite: bool

    def trainer_options(self) -> TrainOptions:
        """These options as the Trainer takes them (runtime/optim.py)."""
        schedule = Schedule(
            self.lr, self.steps, self.warmup, self.decay, self.min_lr, self.decay_fraction
        )
        return TrainOptions(
            schedule,
            self.optimizer,
            self.optimizer_impl,
            self.betas,
            self.eps,
            self.weight_decay,
            self.precision,
            self.max_norm,
            bool(self.zero),
            self.skip_nonfinite,
        )

    def zero_error(self, dp: int) -> str | None:
        """`--zero 1` on a build of `dp` data-parallel copies: None when it can shard, else
        why (the build decides, so launch.py's preflight and `pipec run` ask)."""
        if self.zero and dp < 2:
            return (
                "--zero 1 shards the optimizer over data-parallel copies, and this build has one; "
                "compile with --dp 2 or more, or drop --zero"
            )
        return None


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints go (None: nowhere), every how many steps (0: at the end only), and
    what the run resumes from."""

    save: Path | None
    save_every: int
    resume: Path | None


@dataclass(frozen=True)
class MetricsConfig:
    """The warm-up steps left out of the measured medians, MFU's peak and TensorBoard's
    directory."""

    skip: int
    peak_tflops: float | None
    tensorboard: Path | None


@dataclass(frozen=True)
class EvalConfig:
    """Evaluate after every `eval_every` steps (0: never) on `eval_steps` batches."""

    eval_every: int
    eval_steps: int


@dataclass(frozen=True)
class LaunchConfig:
    """A run's options by section (torchtitan's JobConfig is the model)."""

    run: RunConfig
    training: TrainingConfig
    checkpoint: CheckpointConfig
    metrics: MetricsConfig
    eval: EvalConfig

    def to_json(self) -> dict:
        """Every option's value by its name, JSON-ready (paths as strings):
        measured/config.json."""
        out = {}
        for section in (self.run, self.training, self.checkpoint, self.metrics, self.eval):
            for f in fields(section):
                value = getattr(section, f.name)
                out[f.name] = str(value) if isinstance(value, Path) else value
        return out

    def training_line(self) -> str:
        """What a run trains with: printed before its first step, so a log (or the docs'
        transcript of one) says which command made it."""
        t, saving = self.training, ""
        if self.checkpoint.save:
            every = self.checkpoint.save_every
            saving = f"; checkpoints to {self.checkpoint.save} "
            saving += f"every {every} steps and at the end" if every else "at the end"
        name = {"adamw": "AdamW", "sgd": "SGD"}.get(t.optimizer, t.optimizer)
        if t.optimizer_impl != "foreach":
            name += f" ({t.optimizer_impl})"
        return f"training to step {t.steps}: {name} lr {t.lr:g}, seed {t.seed}{saving}"


#: The sections' types by their names in LaunchConfig (runtime/options.py fills them).
SECTIONS: dict[str, type] = get_type_hints(LaunchConfig)
