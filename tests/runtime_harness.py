"""Many runtime cases inside ONE torchrun launch (each launch costs seconds: processes, imports).

    torchrun --standalone --nproc-per-node 4 tests/runtime_harness.py CASES.json RESULTS_DIR

CASES.json lists {"name", "build", "kind": "grads" | "train" | "memory", "steps", "lr"}, and for
a grads case optionally "comm" (a forced transport: `TRANSPORTS`) and "device". For each
case every rank rebuilds its stages from the build, runs its program and writes to
RESULTS_DIR/<rank>.json what the runtime tests assert: its parameter gradients compared with a
single-process reference on the same micro-batches (grads: the comparison
`launch.py --check-grads` makes), the loss curve beside the
reference's (train, rank 0), and the stash counter's peak. A memory case trains `steps` steps
with AdamW, compares the first step's gradients with the reference, reports the real peak bytes
of the steps after the first (runtime/meter.py) and watches every send (`SendWatch`).
"""

from pipec.runtime.faults import take_termination_signals

take_termination_signals()  # before torch starts threads, as launch.py does

import json
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from pipec.build_dir import load
from pipec.frontend import load_factory
from pipec.runtime.data import micro_batch
from pipec.runtime.faults import Watchdog
from pipec.runtime.gradcheck import GradCapture, compare, reference_grads
from pipec.runtime.interpreter import HANDLERS
from pipec.runtime.loop import train, write_measurements
from pipec.runtime.p2p import Comm, Kind
from pipec.runtime.rank import Rank
from pipec.runtime.transport import Transport
from tests.capture_reuse import reuse_captures

TIMEOUT_S = 60.0
CPU = torch.device("cpu")


class CapturingAdamW(torch.optim.AdamW):
    """AdamW that keeps a copy of the first step's gradients before stepping."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float) -> None:
        super().__init__(params, lr=lr)
        self.params = params
        self.grads: dict[int, torch.Tensor] | None = None

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        if self.grads is None:
            self.grads = {id(p): p.grad.detach().clone() for p in self.params if p.grad is not None}
        return super().step(closure)


class SendWatch:
    """Checks at every instruction that the runtime lets a sent buffer go once its send has
    completed: the comm drops a completed send at the next instruction boundary, and the
    storages of a gradient or stash send (nothing else on the rank keeps them; an activation
    stays in its stash) are freed within `slack` instructions of the completion."""

    SOLE = (Kind.GRAD, Kind.STASH, Kind.STASH_BACK)

    def __init__(self, rt: Rank, slack: int = 2) -> None:
        self.rt, self.slack = rt, slack
        self.watched: list[tuple[object, list[StorageWeakRef]]] = []
        self.checked, self.worst, self.errors = 0, 0, []
        send = rt.comm.send

        def watched_send(kind, stage, mb, peer, tensors):  # type: ignore[no-untyped-def]
            refs = [StorageWeakRef(t.untyped_storage()) for t in tensors]
            send(kind, stage, mb, peer, tensors)
            self.watched.append((rt.comm.in_flight[-1], refs if kind in self.SOLE else []))

        rt.comm.send = watched_send

    def wrap(self, handlers):  # type: ignore[no-untyped-def]
        def checked(handler):  # type: ignore[no-untyped-def]
            def run(rt: Rank, instr) -> None:  # type: ignore[no-untyped-def]
                self.check(rt.comm.clock)
                handler(rt, instr)

            return run

        return {op: checked(h) for op, h in handlers.items()}

    def check(self, k: int) -> None:
        """At the start of instruction k (the comm's clock): what the poll after instruction
        k - 1 should have let go."""
        flying = {id(out) for out in self.rt.comm.in_flight}
        left = []
        for out, refs in self.watched:
            done = out.completed_at
            if done is None:
                left.append((out, refs))
                continue
            if done < k - 1 and id(out) in flying:
                self.errors.append(f"{out.key} completed at {done}, still held at {k}")
            if any(not r.expired() for r in refs):
                lag = k - done
                self.worst = max(self.worst, lag)
                if lag > self.slack:
                    self.errors.append(f"{out.key} completed at {done}, storage alive at {k}")
                left.append((out, refs))
                continue
            self.checked += 1
        self.watched = left


@cache
def reference(
    spec: str,
    seed: int,
    n_mb: int,
    micro_batch_size: int | None = None,
    device: torch.device = CPU,
) -> dict[str, torch.Tensor]:
    """Gradients of the unsplit model on `device`: mean loss over micro-batches 0..n_mb-1."""
    ms = load_factory(spec, seed, micro_batch_size)
    batches = [micro_batch(ms, i) for i in range(n_mb)]
    return reference_grads(ms.model, ms.loss_fn, batches, device)


def reference_losses(
    spec: str, seed: int, n_mb: int, steps: int, lr: float, micro_batch_size: int | None = None
) -> list[float]:
    """The single-process training curve: AdamW on the same micro-batches."""
    ms = load_factory(spec, seed, micro_batch_size)
    opt = torch.optim.AdamW(ms.model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(n_mb):
            inputs, target = micro_batch(ms, i)
            loss = ms.loss_fn(ms.model(*inputs), target)
            (loss / n_mb).backward()
            total += loss.item()
        opt.step()
        losses.append(total / n_mb)
    return losses


def compare_grads(rt: Rank, captured: dict[int, torch.Tensor]) -> dict:
    """`launch.py --check-grads`'s comparison; an AssertionError names the first mismatch."""
    model = rt.build.plan["model"]
    size = model.get("micro_batch_size")
    ref = reference(model["spec"], model["seed"], rt.layout.m * rt.dp, size, rt.device)
    checks = compare(rt.modules, rt.grank, captured, ref)
    errors = [c.error for c in checks if c.error]
    if errors:
        raise AssertionError(errors[0])
    return {
        "max_abs_diff": max(c.max_abs_diff for c in checks),
        "names": sorted({n for c in checks for n in c.names}),
    }


#: Transports a case may force (`"comm"`; default: the backend's for the device): NCCL's
#: protocol over gloo (batches, matched in issue order), and gloo staged through host memory.
TRANSPORTS = {"nccl": Transport("nccl"), "staged": Transport("gloo", staged=True)}


def watch_comm(comm: Comm) -> dict[str, list[int]]:
    """Count what the transport does: messages per issued batch, host copies out and in."""
    seen: dict[str, list[int]] = {"batches": [], "staged_out": [], "staged_in": []}
    flush = comm.flush

    def counted_flush() -> None:
        if comm._batch:
            seen["batches"].append(len({id(entry[-1]) for entry in comm._batch}))
        flush()

    comm.flush = counted_flush
    if comm.staging is not None:
        out, into = comm.staging.out, comm.staging.into

        def counted_out(tensors):  # type: ignore[no-untyped-def]
            seen["staged_out"].append(len(tensors))
            return out(tensors)

        def counted_into(buffers, host):  # type: ignore[no-untyped-def]
            seen["staged_in"].append(len(buffers))
            into(buffers, host)

        comm.staging.out, comm.staging.into = counted_out, counted_into
    return seen


def run_case(case: dict, watchdog: Watchdog) -> dict:
    build = load(Path(case["build"]))
    # "cuda": every rank shares GPU 0, named with its index (set_device refuses a bare "cuda")
    device = torch.device("cuda", 0) if case.get("device") == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rt = Rank.prepare(build, dist.get_rank(), dist.get_world_size(), device)
    watchdog.describe = rt.describe
    if case["kind"] == "grads":
        rt.connect(GradCapture, TIMEOUT_S, TRANSPORTS.get(case.get("comm", "")))
        seen = watch_comm(rt.comm)
        train(rt, 1, HANDLERS, watchdog)
        result = compare_grads(rt, rt.optimizer.grads) | seen
    elif case["kind"] == "memory":
        rt.connect(lambda ps: CapturingAdamW(ps, case["lr"]), TIMEOUT_S)
        watch = SendWatch(rt)
        traces = train(rt, case["steps"], watch.wrap(HANDLERS), watchdog)
        write_measurements(rt, traces, skip=1)
        result = compare_grads(rt, rt.optimizer.grads)
        real, state = max((t.real_peak, t.state_at_peak) for t in traces[1:])
        result |= {
            "real_peak_bytes": real,
            "model_state_at_peak_bytes": state,
            "sends_checked": watch.checked,
            "send_release_lag": watch.worst,
            "send_errors": watch.errors[:5],
        }
    else:
        lr, steps = case["lr"], case["steps"]
        rt.connect(lambda ps: torch.optim.AdamW(ps, lr=lr), TIMEOUT_S)
        losses: list[float] = []
        traces = train(rt, steps, HANDLERS, watchdog, lambda step, loss, t: losses.append(loss))
        write_measurements(rt, traces, skip=1)  # OUT/measured/, as launch.py writes it
        result = {"losses": losses}
        if dist.get_rank() == 0:
            model = build.plan["model"]
            result["reference"] = reference_losses(
                model["spec"], model["seed"], rt.layout.m, steps, lr, model.get("micro_batch_size")
            )
    return result | {"peak_stash_bytes": rt.stash_bytes.peak, "ok": True}


def serve(run: Callable[[dict, Watchdog], dict]) -> None:
    """Run every case of CASES.json (argv[1]) with `run` in one process group (gloo, one thread
    per rank); write this rank's results by case name to RESULTS_DIR/<rank>.json (argv[2])."""
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    torch.set_num_threads(1)
    reuse_captures()  # one capture per model, not per case (tests/capture_reuse.py)
    dist.init_process_group("gloo")
    watchdog = Watchdog(TIMEOUT_S, lambda k: f"rank {dist.get_rank()}")
    results = {}
    for case in cases:
        try:
            results[case["name"]] = run(case, watchdog)
        except AssertionError as e:  # a wrong gradient: record it, the other cases go on
            results[case["name"]] = {"ok": False, "error": str(e)[:2000]}
    (out / f"{dist.get_rank()}.json").write_text(json.dumps(results))
    watchdog.stop()
    dist.destroy_process_group()


if __name__ == "__main__":
    serve(run_case)
