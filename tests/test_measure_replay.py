"""runtime/measure.py's replay: a step's programs played with each op's own measured duration.

Fed the simulator's own durations, the replay is the simulated makespan (so each measured op
lands on its own node: stage, micro-batch and kind, including fused, split and mixed
backwards); scaled, it scales; and a measured step that waited longer than the latency reads
makespan / replay above 1 by exactly the wait."""

import pytest

from pipec.ir import COMPUTE_OPS
from pipec.runtime.measure import RankReport, replayed_ms, summarize
from tests.helpers import run

CASES = [
    ("1f1b", 4, 8, None, "F=1,B=2,W=0,comm=0.3"),
    ("zb-h1", 4, 8, None, "F=1,B=1,W=1,comm=0.2"),
    ("interleaved", 2, 4, 2, "F=1:2:1:1,B=2:3:2:2,W=0,comm=0.1"),
    ("dualpipev", 2, 4, None, "F=1,B=1,W=1,comm=0.1"),
    ("v-half", 4, 8, None, "F=1,B=1,W=1,comm=0.2"),
]


def reports(result, scale: float = 1.0, wait: float = 0.0) -> list[RankReport]:
    """One step per rank whose ops took the simulator's durations × `scale`; each rank's
    (first, last) compute times are the simulated ones, the step's last op ending `wait` later."""
    out = []
    timeline = result.sim.timeline
    latest = max(range(len(timeline)), key=lambda r: timeline[r][-1].end)
    for r, slots in enumerate(timeline):
        ops = tuple((s.end - s.start) * scale for s in slots)
        first, last = slots[0].start * scale, slots[-1].end * scale
        if r == latest:
            last += wait
        n = len(result.compiled.programs[r])
        step = (last, sum(ops), first, last)
        out.append(RankReport(r, 0, n, (step,), ((0, 0),), (ops,), (), (), 0.0, "cpu"))
    return out


def ops(step: list[RankReport]) -> dict[int, tuple[float, ...]]:
    return {r.rank: r.ops[0] for r in step}


@pytest.mark.parametrize(("name", "p", "m", "v", "costs"), CASES)
def test_the_simulators_own_durations_replay_to_its_makespan(name, p, m, v, costs):
    result = run(name, p, m, v, costs)
    c = result.compiled
    assert [len(s) for s in result.sim.timeline] == [
        sum(i.op in COMPUTE_OPS for i in prog) for prog in c.programs
    ]
    replay = replayed_ms(ops(reports(result)), c, result.costs)
    assert replay == pytest.approx(result.sim.makespan)
    # Twice as slow with no latency: twice the makespan at no latency.
    no_comm = run(name, p, m, v, costs.rsplit(",", 1)[0] + ",comm=0")
    twice = replayed_ms(ops(reports(no_comm, scale=2.0)), no_comm.compiled, no_comm.costs)
    assert twice == pytest.approx(2 * no_comm.sim.makespan)


def test_a_step_that_waited_reads_its_wait_over_the_replay():
    result = run("1f1b", 4, 8, None, "F=1,B=2,W=0,comm=0.3")
    makespan = result.sim.makespan
    stats = summarize(reports(result, wait=0.25 * makespan), result.compiled, result.costs, "x", 0)
    step = stats["per_step"][0]
    assert step["replay_ms"] == pytest.approx(makespan)
    assert step["makespan_ms"] == pytest.approx(1.25 * makespan)
    assert stats["measured"]["makespan_over_replay"] == pytest.approx(1.25)
