"""Shared by the real-memory runtime tests: compile a model's memory cases, run them all in one
torchrun launch (tests/runtime_harness.py's memory kind: three AdamW steps, the first step's
gradients against the single-process reference, the real peak of the later steps, every send
watched) and predict each case's peaks (runtime/measure.py's `predicted_peaks`, CPU)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from passes.memory_bytes import RankBytes
from pipec.compile import CompileResult
from pipec.ir import Op
from pipec.model import compile_model
from runtime.measure import predicted_peaks
from tests.runtime_launch import launch

ROOT = Path(__file__).resolve().parents[1]
CASES = ("1f1b", "1f1b-evict", "v-min", "v-half", "zb-h1")
MEMORY = {"kind": "memory", "steps": 3, "lr": 1e-3}


@dataclass(frozen=True)
class MemoryRuns:
    """Per case: the compiled result, the predicted peaks and every rank's results."""

    compiled: dict[str, CompileResult]
    predicted: dict[str, tuple[RankBytes, ...]]
    results: list[dict]

    def real(self, case: str) -> list[int]:
        return [res[case]["real_peak_bytes"] for res in self.results]

    def activations(self, case: str, rank: int) -> int:
        """The real peak less the parameters, gradients and optimizer state alive at it."""
        res = self.results[rank][case]
        return res["real_peak_bytes"] - res["model_state_at_peak_bytes"]


def run_memory_cases(factory: str, p: int, m: int, tmp: Path, timeout: float) -> MemoryRuns:
    spec = f"{ROOT}/examples/gpt.py:{factory}"
    compiled = {
        case: compile_model(spec, case.removesuffix("-evict"), p, m, evict=case.endswith("-evict"))
        for case in CASES
    }
    run = launch({c: (r, MEMORY) for c, r in compiled.items()}, p, tmp, timeout)
    predicted = {
        c: predicted_peaks(r.plan, r.compiled, r.costs, r.sim, "cpu") for c, r in compiled.items()
    }
    return MemoryRuns(compiled, predicted, run.results)


def check_gradients(runs: MemoryRuns, case: str) -> None:
    for rank, res in enumerate(runs.results):
        assert res[case]["ok"], f"rank {rank}: {res[case]['error']}"
    assert max(res[case]["max_abs_diff"] for res in runs.results) == 0.0


def check_real_peaks(runs: MemoryRuns, case: str, tolerance: float = 0.10) -> None:
    for rank, (peak, real) in enumerate(zip(runs.predicted[case], runs.real(case))):
        assert abs(real - peak.total) <= tolerance * peak.total, (rank, real, peak.to_json())


def check_eviction(runs: MemoryRuns) -> None:
    """Rank 0's real peak falls by at least 70% of the predicted saving; every acceptor's
    rises by at most its predicted share plus 10%."""
    plain, evict = runs.predicted["1f1b"], runs.predicted["1f1b-evict"]
    real_plain, real_evict = runs.real("1f1b"), runs.real("1f1b-evict")
    saving = plain[0].total - evict[0].total
    assert saving > 0
    assert real_plain[0] - real_evict[0] >= 0.7 * saving, (real_plain[0], real_evict[0], saving)
    programs = runs.compiled["1f1b-evict"].compiled.programs
    acceptors = [r for r, prog in enumerate(programs) if any(i.op is Op.ACCEPT for i in prog)]
    assert acceptors
    for rank in acceptors:
        share = evict[rank].total - plain[rank].total
        rise = real_evict[rank] - real_plain[rank]
        assert 0 < share and rise <= 1.1 * share, (rank, rise, share)


def check_sends(runs: MemoryRuns, case: str) -> None:
    """No sent buffer outlived its completed send by more than the watch's slack."""
    for rank, res in enumerate(runs.results):
        assert res[case]["send_errors"] == [], (rank, res[case]["send_errors"])
        assert res[case]["sends_checked"] > 0
