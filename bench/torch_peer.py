"""One rank of bench/compare_torch.py: pipec's runtime and torch's on the same stages, A B A B.

    torchrun --standalone --nproc-per-node P bench/torch_peer.py CASES.json RESULTS.json

A case is a pipec build (programs plus the model plan) and a torch schedule class with the pipec
build of that class's order (the same build when pipec runs torch's order). Both runtimes get
the same stage modules (`build_stages` of the build's plan: same partition, same seed), the same
micro-batches (`runtime.data`), AdamW with the same learning rate and the same torch threads,
inside one process group. Steps alternate, pipec then torch, each after a barrier; an iteration
is one step including the optimizer step, timed on every rank and taken as the slowest rank's;
its CPU time (every thread, summed over ranks) is the work it did, which load on the machine
disturbs less than wall time. Memory is each runtime's peak of live saved activations (each
storage once, parameters excluded): pipec's own meter (stash plus W-pending bytes) and, for
torch, the same count taken by saved-tensor hooks in the warm-up steps only, so that the hooks'
cost stays out of torch's timed steps.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.pipelining import PipelineStage, schedules

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipec.build_dir import Build, load
from pipec.frontend import build_stages
from pipec.ir import Op
from pipec.runtime.data import micro_batch
from pipec.runtime.faults import Watchdog
from pipec.runtime.interpreter import HANDLERS, StepTrace, run_program
from pipec.runtime.measure import replayed_ms
from pipec.runtime.rank import Rank
from pipec.runtime.stash import storage_key
from pipec.torch_orders import SINGLE_STAGE

LR = 1e-3
TIMEOUT_S = 120.0
#: The ops whose durations the replay takes (bench/runtime.py's `replay`).
COMPUTE = frozenset({Op.F, Op.B, Op.BW, Op.W, Op.RECOMPUTE})


class SavedBytes:
    """Live bytes autograd holds for backwards (each storage once, parameters excluded)."""

    def __init__(self, param_keys: set[int]) -> None:
        self.param_keys = param_keys
        self.refs: dict[int, int] = {}  # storage key -> saved tensors holding it
        self.live = self.peak = 0

    def pack(self, t: Tensor) -> object:
        key = storage_key(t)
        if key in self.param_keys:
            return t
        if key not in self.refs:
            self.live += t.untyped_storage().nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        return _Held(self, key, t)

    @staticmethod
    def unpack(h: object) -> Tensor:
        return h.tensor if isinstance(h, _Held) else h  # type: ignore[return-value]

    def release(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= nbytes


class _Held:
    """A saved tensor; autograd dropping it (graph freed) releases its storage's bytes."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: SavedBytes, key: int, tensor: Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter.release(self.key, self.tensor.untyped_storage().nbytes())


class TorchRun:
    """torch.distributed.pipelining's schedule `cls_name` over this rank's stages of `build`
    (the pipec build of torch's order: its plan cuts the model for that order's placement)."""

    def __init__(self, build: Build, rt: Rank, cls_name: str) -> None:
        layout, model_plan = build.compiled.layout, build.plan["model"]
        mine = sorted(s for s in range(layout.n_stages) if layout.stage_rank[s] == rt.rank)
        modules = build_stages(None, model_plan, [layout.stage_chunk[s] for s in mine])
        stages = [
            PipelineStage(mod, s, layout.n_stages, rt.device) for s, mod in zip(mine, modules)
        ]
        cls = getattr(schedules, cls_name)
        loss = rt.spec.loss_fn
        m = layout.m
        self.schedule = (
            cls(stages[0], m, loss_fn=loss)
            if cls_name in SINGLE_STAGE
            else cls(stages, m, loss_fn=loss)
        )
        params = [p for mod in modules for p in mod.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=LR)
        self.meter = SavedBytes({storage_key(p) for p in params})
        batches = [micro_batch(rt.spec, mb, rt.data_seed) for mb in range(m)]
        self.first, self.last = 0 in mine, layout.n_stages - 1 in mine
        self.inputs = tuple(torch.cat(xs) for xs in zip(*(x for x, _ in batches)))
        self.target = torch.cat([y for _, y in batches])
        self.losses: list[Tensor] = []

    def step(self, metered: bool) -> None:
        args = self.inputs if self.first else ()
        kwargs = {"target": self.target, "losses": self.losses} if self.last else {}
        self.losses.clear()
        if metered:
            with torch.autograd.graph.saved_tensors_hooks(self.meter.pack, self.meter.unpack):
                self.schedule.step(*args, **kwargs)
        else:
            self.schedule.step(*args, **kwargs)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def loss(self) -> float:
        return float(sum(x.item() for x in self.losses) / len(self.losses)) if self.losses else 0.0


def _timed(step: Callable[[], None]) -> tuple[float, float]:
    """Wall and CPU seconds (this process, every thread: gloo's too) of one step."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    step()
    return time.perf_counter() - t0, time.process_time() - c0


def op_ms(
    rt: Rank, traces: list[StepTrace], comm: float
) -> tuple[dict[str, list[float]], list[float], list[float]]:
    """Every rank's compute durations in `traces` (ms, from each op's start, its inputs there,
    to its end) by op and stage ("F 3"), each rank's median optimizer step, and each step's
    replay (runtime/measure.py: the programs played with that step's own op durations and
    latency `comm`) plus its slowest optimizer step: the step with no wait beyond the latency."""
    mine: dict[str, list[float]] = {}
    steps, per_step = [], []
    for trace in traces:
        durations, step = [], 0.0
        for i, s, e in zip(rt.program, trace.start, trace.end):
            if i.op in COMPUTE:
                mine.setdefault(f"{i.op.value} {i.stage}", []).append((e - s) * 1e3)
                durations.append((e - s) * 1e3)
            elif i.op is Op.OPTIMIZER_STEP:
                step += (e - s) * 1e3
        steps.append(step)
        per_step.append(durations)
    every: list[tuple | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (mine, steps, per_step))
    ops = {k: v for d, _, _ in every for k, v in d.items()}  # every stage on one rank
    costs = replace(rt.build.costs, comm=comm)
    replays = [
        replayed_ms({r: e[2][k] for r, e in enumerate(every)}, rt.build.compiled, costs)
        + max(e[1][k] for e in every)
        for k in range(len(traces))
    ]
    return ops, [statistics.median(e[1]) if e[1] else 0.0 for e in every], replays


def _across_ranks(wall: list[float], cpu: list[float]) -> list[float]:
    """The slowest rank's wall times, then the CPU times summed over ranks."""
    t = torch.tensor(wall, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    c = torch.tensor(cpu, dtype=torch.float64)
    dist.all_reduce(c)
    return t.tolist() + c.tolist()


def run_case(case: dict, grank: int, world: int, warmup: int, pairs: int, comm: float) -> dict:
    """Warm-up steps (torch's metered), then `pairs` timed pipec/torch pairs."""
    build = load(Path(case["build"]))
    rt = Rank.prepare(build, grank, world, torch.device("cpu"))
    rt.connect(lambda params: torch.optim.AdamW(params, lr=LR), TIMEOUT_S)
    watchdog = Watchdog(TIMEOUT_S, rt.describe)
    peer = TorchRun(load(Path(case["torch_build"])), rt, case["torch"])

    traces: list[StepTrace] = []

    def pipec_step() -> None:
        traces.append(run_program(rt, HANDLERS, watchdog))

    first_loss = [0.0, 0.0]
    for k in range(warmup):
        pipec_step()
        peer.step(metered=True)
        if k == 0:  # both start from the same weights: the first step's loss must agree
            first_loss = [
                rt.loss_sums()[0].item() / max(len(rt.step_state.losses), 1),
                peer.loss(),
            ]
        rt.step_state.losses.clear()
    times: list[list[float]] = []
    for _ in range(pairs):
        a, a_cpu = _timed(pipec_step)
        rt.step_state.losses.clear()
        b, b_cpu = _timed(lambda: peer.step(metered=False))
        times.append(_across_ranks([a, b], [a_cpu, b_cpu]))
    watchdog.stop()
    ops, steps, replays = op_ms(rt, traces[warmup:], comm)
    losses = torch.tensor(first_loss, dtype=torch.float64)
    dist.all_reduce(losses)  # one rank holds the last stage's losses (V: rank 0)
    peaks = [torch.zeros(world, dtype=torch.int64) for _ in range(2)]
    peaks[0][grank] = rt.stash_bytes.peak
    peaks[1][grank] = peer.meter.peak
    for t in peaks:
        dist.all_reduce(t)
    return {
        **case,
        "pipec_ms": [t[0] * 1e3 for t in times],
        "torch_ms": [t[1] * 1e3 for t in times],
        "pipec_cpu_ms": [t[2] * 1e3 for t in times],
        "torch_cpu_ms": [t[3] * 1e3 for t in times],
        "pipec_op_ms": ops,
        "pipec_step_ms": steps,
        "pipec_replay_ms": replays,
        "first_loss": losses.tolist(),
        "pipec_peak_bytes": peaks[0].tolist(),
        "torch_peak_bytes": peaks[1].tolist(),
    }


def main() -> None:
    cases_path, out_path = sys.argv[1:3]
    job = json.loads(Path(cases_path).read_text())
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo")
    grank = dist.get_rank()
    results = []
    for case in job["cases"]:
        model = case["model"]
        pairs, comm = job["pairs"][model], job["latency_ms"][model]
        results.append(run_case(case, grank, world, job["warmup"], pairs, comm))
        if grank == 0:
            print(f"done {case['model']} {case['label']}", flush=True)
    if grank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
