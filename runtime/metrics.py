"""Training metrics: what each step prints, and writes to measured/metrics.jsonl and TensorBoard.

Per step: the loss, the learning rate, the gradient norm (when the optimizer step measures it),
the throughput in tokens/s (samples/s when the model's first input is not token ids), the
achieved TFLOP/s per rank, MFU and each rank's real peak memory.

Figures come from two places. The plan holds the FLOPs of every stage's F, B and W for one
micro-batch, counted at compile time by `FlopCounterMode` (pipec/frontend/cost.py); a rank's
model FLOPs per step are those of the compute instructions of its program (F, B, W, BW: a
RECOMPUTE repeats work and is not model FLOPs), so rank 0 knows every rank's from the build.
What only a rank knows, its loss sum, step time and real peak (runtime/meter.py), travels in
one small tensor per rank, gathered once per step where the loss sum was reduced before: no
collective is added. The step's time is the slowest rank's (all begin at the step barrier);
tokens/s = tokens per step ÷ step time; a rank's TFLOP/s = its FLOPs ÷ step time; MFU = the
step's FLOPs ÷ (step time × ranks × peak FLOP/s of one device).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

import torch
import torch.distributed as dist

from pipec.build_dir import MEASURED
from pipec.ir import Op, Program
from pipec.runtime.restart import attempt

if TYPE_CHECKING:
    from pipec.build_dir import Build
    from pipec.frontend import ModelSpec
    from pipec.runtime.config import LaunchConfig
    from pipec.runtime.interpreter import StepTrace
    from pipec.runtime.rank import Rank

#: Dense (no sparsity) peak TFLOP/s of one device by precision, bf16 on the tensor cores and
#: fp32 without TF32 (torch's default for matmuls), from the vendors' data sheets. The first
#: pattern found in `torch.cuda.get_device_name()` wins, so the specific names come first.
PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    (r"GH200", 989.0, 67.0),
    (r"H200", 989.0, 67.0),
    (r"H100 PCIe", 756.0, 51.0),
    (r"H100 NVL", 835.0, 60.0),
    (r"H100", 989.0, 67.0),  # SXM ("NVIDIA H100 80GB HBM3")
    (r"A100", 312.0, 19.5),
    (r"L40S", 362.0, 91.6),
    (r"\bL4\b", 121.0, 30.3),
    (r"\bA10\b", 125.0, 31.2),
)

#: The per-rank figures each step gathers, in this order.
ROW = ("loss_sum", "losses", "wall_s", "real_peak", "lr", "grad_norm", "stopping")


def known_peak_tflops(device_name: str, precision: str) -> float | None:
    """The table's peak for a device name and "bf16" or "fp32" (None: not in the table)."""
    for pattern, bf16, fp32 in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return bf16 if precision == "bf16" else fp32
    return None


def peak_flops(device: torch.device, precision: str, given_tflops: float | None) -> float | None:
    """Peak FLOP/s of one rank's device: `--peak-tflops`, else the table's for this GPU; None
    (no MFU) on a CPU or an unknown GPU."""
    if given_tflops is not None:
        return given_tflops * 1e12
    if device.type != "cuda":
        return None
    known = known_peak_tflops(torch.cuda.get_device_name(device), precision)
    return None if known is None else known * 1e12


def program_flops(plan: dict, stage_chunk: Sequence[int], program: Program) -> float:
    """Model FLOPs of one execution of `program`: its F, B, W and BW at the plan's per-chunk
    figures (a fused BW is B + W; RECOMPUTE is not counted)."""
    stages = plan["model"]["stages"]
    total = 0.0
    for instr in program:
        if instr.op in (Op.F, Op.B, Op.W, Op.BW):
            f = stages[stage_chunk[instr.stage]]["flops"]
            total += f["B"] + f["W"] if instr.op is Op.BW else f[instr.op.value]
    return total


def batch_unit(spec: ModelSpec) -> tuple[str, int]:
    """What one micro-batch counts as: ("tokens", ids in it) when the first input is integer
    token ids of shape (rows, positions, …), else ("samples", its rows)."""
    first = spec.example_inputs[0]
    if not first.is_floating_point() and first.dim() >= 2:
        return "tokens", first.numel()
    return "samples", first.shape[0] if first.dim() else 1


def last_step(rt: Rank) -> tuple[float, float]:
    """The learning rate of the optimizer step just taken and its gradient norm (nan: no step
    taken, e.g. under --check-grads' stand-in optimizer); a norm still being summed is waited
    for."""
    numbers = rt.step_state.numbers()
    if numbers is None:
        return math.nan, math.nan
    return numbers.lr, numbers.grad_norm


def gather_step(
    rt: Rank, trace: StepTrace, stopping: bool = False
) -> tuple[list[torch.Tensor], dist.Work]:
    """Start gathering this rank's figures of the step (ROW) from every rank (asynchronous);
    `stopping`: this rank was asked to stop (a signal) and will stop after this step."""
    lr, grad_norm = last_step(rt)
    row = torch.tensor(
        [0.0, len(rt.step_state.losses), trace.wall_s, trace.real_peak, lr, grad_norm, stopping],
        dtype=torch.float64,
        device=rt.device,
    )
    row[0] = rt.loss_sums()[0]  # on the device: no wait for the GPU here
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    return rows, dist.all_gather(rows, row, async_op=True)


@dataclass(frozen=True)
class StepFigures:
    """One step as every rank measured it: `step` counts from 1; per-rank tuples by global
    rank; `loss` the mean over every micro-batch; lr and grad norm None when unknown."""

    step: int
    loss: float
    lr: float | None
    grad_norm: float | None
    wall_s: tuple[float, ...]
    real_peak: tuple[int, ...]
    stopping: bool = False

    @staticmethod
    def of(step: int, rows: list[torch.Tensor]) -> StepFigures:
        by = dict(zip(ROW, zip(*torch.stack(rows).tolist())))
        count = sum(by["losses"])
        lr, norm = by["lr"][0], by["grad_norm"][0]
        return StepFigures(
            step,
            sum(by["loss_sum"]) / count if count else math.nan,
            None if math.isnan(lr) else lr,
            None if math.isnan(norm) else norm,
            tuple(by["wall_s"]),
            tuple(int(b) for b in by["real_peak"]),
            any(by["stopping"]),
        )

    @property
    def step_s(self) -> float:
        return max(self.wall_s)


class Metrics:
    """Rank 0's log: a line per step on stdout, a JSON object per step in `path` (after the
    lines there with `append`), and scalars to `board` (a SummaryWriter) when given. `eval`
    results join the record of their step."""

    def __init__(
        self,
        build: Build,
        spec: ModelSpec,
        steps: int,
        peak: float | None,
        path: Path,
        board: object | None = None,
        append: bool = False,
    ) -> None:
        c, layout = build.compiled, build.compiled.layout
        dp = int(build.plan.get("dp", 1))
        per_program = [program_flops(build.plan, layout.stage_chunk, p) for p in c.programs]
        self.flops = [per_program[g % c.world] for g in range(c.world * dp)]
        self.unit, per_mb = batch_unit(spec)
        self.per_step = per_mb * c.m * dp
        self.steps, self.peak, self.board = steps, peak, board
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file: IO[str] = path.open("a" if append else "w")
        self.evals: dict[int, tuple[float, int]] = {}

    def record(self, fig: StepFigures) -> dict:
        """The step's metrics.jsonl object (see docs/training.md for the fields)."""
        t = fig.step_s
        tflops = [f / t / 1e12 for f in self.flops]
        mfu = sum(self.flops) / (t * len(self.flops) * self.peak) if self.peak else None
        out = {
            "step": fig.step,
            "loss": fig.loss,
            "lr": fig.lr,
            "grad_norm": fig.grad_norm,
            "step_s": t,
            f"{self.unit}_per_step": self.per_step,
            f"{self.unit}_per_s": self.per_step / t,
            "flops_per_rank": self.flops,
            "tflops_per_rank": tflops,
            "peak_tflops": self.peak / 1e12 if self.peak else None,
            "mfu": mfu,
            "wall_s_per_rank": list(fig.wall_s),
            "real_peak_bytes_per_rank": list(fig.real_peak),
        }
        if fig.step in self.evals:
            out["eval_loss"], out["eval_batches"] = self.evals.pop(fig.step)
        return out

    def log(self, fig: StepFigures, saved: Sequence[Path] | None = None) -> None:
        """Say step `fig`'s figures, and the checkpoints `saved` since the last line."""
        r = self.record(fig)
        parts = [f"step {fig.step:>3}/{self.steps}", f"loss {fig.loss:.4f}"]
        if fig.lr is not None:
            parts.append(f"lr {fig.lr:.2e}")
        if fig.grad_norm is not None:
            parts.append(f"gnorm {fig.grad_norm:.3g}")
        short = "tok" if self.unit == "tokens" else "samples"
        parts.append(f"{_si(r[f'{self.unit}_per_s'])}{short}/s")
        parts.append(f"{_si(sum(self.flops) / len(self.flops) / fig.step_s)}FLOP/s/rank")
        if r["mfu"] is not None:
            parts.append(f"MFU {r['mfu']:.1%}")
        parts.append(f"mem {max(fig.real_peak) / 2**20:.1f} MiB")
        parts.append(f"({fig.step_s * 1000:.1f} ms)")
        parts += [f"saved {path}" for path in saved or ()]
        print("  ".join(parts), flush=True)
        if "eval_loss" in r:
            print(
                f"eval after step {fig.step}: loss {r['eval_loss']:.4f} "
                f"({r['eval_batches']} batches)",
                flush=True,
            )
        self.file.write(json.dumps(r) + "\n")
        self.file.flush()
        if self.board is not None:
            self._scalars(r)

    def _scalars(self, r: dict) -> None:
        step = r["step"]
        scalars = {
            "train/loss": r["loss"],
            "train/lr": r["lr"],
            "train/grad_norm": r["grad_norm"],
            f"throughput/{self.unit}_per_s": r[f"{self.unit}_per_s"],
            "throughput/tflops_per_rank": sum(r["tflops_per_rank"]) / len(self.flops),
            "throughput/mfu": r["mfu"],
            "memory/real_peak_bytes": max(r["real_peak_bytes_per_rank"]),
            "eval/loss": r.get("eval_loss"),
        }
        for tag, value in scalars.items():
            if value is not None:
                self.board.add_scalar(tag, value, step)  # type: ignore[attr-defined]

    def eval(self, step: int, loss: float, batches: int) -> None:
        """An evaluation after `step`: printed and recorded with the step's figures."""
        self.evals[step] = (loss, batches)

    def close(self) -> None:
        self.file.close()
        if self.board is not None:
            self.board.close()  # type: ignore[attr-defined]


def _si(x: float) -> str:
    """3 significant digits with k/M/G/T: 12.3k."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {suffix}"
    return f"{x:.3g} "


def open_metrics(rt: Rank, config: LaunchConfig) -> Metrics:
    """Rank 0's metrics log: measured/config.json holds the run's options, metrics.jsonl and
    TensorBoard (--tensorboard DIR) each step's figures."""
    out = rt.build.path / MEASURED
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(config.to_json(), indent=2, sort_keys=True) + "\n")
    board, given = None, config.metrics
    if given.tensorboard is not None:
        from torch.utils.tensorboard import SummaryWriter  # the optional extra: checked in parse

        board = SummaryWriter(str(given.tensorboard))
    peak = peak_flops(rt.device, config.training.precision, given.peak_tflops)
    # A restarted run's lines go on after those of its attempts before (runtime/restart.py).
    jsonl, append = out / "metrics.jsonl", attempt() > 0
    return Metrics(rt.build, rt.spec, config.training.steps, peak, jsonl, board, append)
