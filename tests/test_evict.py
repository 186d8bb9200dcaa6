"""BPipe eviction (issue 5): the balanced bound, the 1F1B figures, golden files, bad limits."""

import math
from dataclasses import replace

import pytest

from pipec.build_dir import render_files
from pipec.compile import compile_schedule
from pipec.ir import Op, PipecError
from pipec.passes.costs import CostModel
from pipec.passes.evict import EvictionPlanner, insert_evictions, smallest_feasible_limit
from pipec.passes.lower import lower
from pipec.passes.registry import Request, build_schedule
from pipec.passes.simulate import simulate
from pipec.passes.topology import make_topology
from pipec.passes.verify import verify
from tests.helpers import peaks


def lowered(name: str, p: int, m: int, costs: CostModel | None = None, v: int = 1):
    costs = costs or CostModel()
    return lower(build_schedule(name, Request(p, m, v, costs)), costs)


def on_one_node(p: int, bandwidth: float, latency: float = 0.0) -> CostModel:
    """Unit costs, one node of p GPUs whose links move `bandwidth` stashes per unit of time."""
    return replace(CostModel(), topology=make_topology(p, 1, None, f"intra={bandwidth}:{latency}"))


@pytest.mark.parametrize("p", range(1, 17))
def test_1f1b_balanced_bound_is_the_smallest_feasible_limit(p):
    """A pair (s, p-1-s) holds p+1 stashes, so every rank can be held to ceil((p+1)/2) and
    no lower; below it the pass refuses with the bound in the message."""
    compiled = lowered("1f1b", p, 2 * p + 3)
    bound = math.ceil((p + 1) / 2)
    assert smallest_feasible_limit(compiled, CostModel()) == bound
    evicted = insert_evictions(compiled, CostModel(), bound)
    sim = simulate(evicted.layout, evicted.programs, CostModel())
    verify(evicted, CostModel(), [r.peak_activations for r in sim.ranks], bound)
    assert max(r.peak_activations for r in sim.ranks) == bound
    if bound > 1:
        with pytest.raises(PipecError, match=rf"smallest feasible limit is {bound}$"):
            insert_evictions(compiled, CostModel(), bound - 1)


def test_1f1b_p8_m32_evict_meets_the_issue_figures():
    """Peak <= 5 on every rank (rank 0 is 8 without); a stash moves in 0.25 T_F and the
    iteration stays within 1% of plain 1F1B; 68 stash units move per iteration."""
    costs = on_one_node(8, bandwidth=4.0)  # one stash in 1/4 of a forward
    plain = compile_schedule("1f1b", 8, 32, costs=costs)
    evicted = compile_schedule("1f1b", 8, 32, costs=costs, evict=True)
    assert peaks(plain) == [8, 7, 6, 5, 4, 3, 2, 1]
    assert evicted.plan["memory_limit"] == 5 and max(peaks(evicted)) <= 5
    assert all(t.end - t.start == pytest.approx(0.25) for t in evicted.sim.transfers)
    assert evicted.sim.makespan <= 1.01 * plain.sim.makespan
    assert evicted.sim.makespan == plain.sim.makespan  # prefetch hides every load
    moves = [i for prog in evicted.compiled.programs for i in prog if i.op in (Op.EVICT, Op.LOAD)]
    assert evicted.sim.moved == len(moves) == 68


def test_only_what_the_limit_requires_is_evicted():
    """At a limit one above the bound fewer stashes move; at the peak none."""
    planner = EvictionPlanner(lowered("1f1b", 8, 32), CostModel())
    moved = []
    for limit in (5, 6, 7, 8):
        c = planner.evict(limit)
        moved.append(sum(i.op is Op.EVICT for prog in c.programs for i in prog))
    assert moved[0] > moved[1] > moved[2] > moved[3] == 0


def test_the_stash_needed_last_is_evicted():
    """Under 1F1B the stash needed last is the most recent forward's: rank 0 at p=4 evicts
    each micro-batch right after computing it, never an older one."""
    c = insert_evictions(lowered("1f1b", 4, 8), CostModel(), 3)
    prog = c.programs[0]
    for k, instr in enumerate(prog):
        if instr.op is Op.EVICT:
            last_f = max(i.mb for i in prog[:k] if i.op is Op.F)
            assert instr.mb == last_f, f"evicts mb {instr.mb} while {last_f} is newer"


def test_prefetch_hides_a_fast_link_and_not_a_slow_one():
    """Leads follow the link: with a stash in 0.25 T_F nothing waits; with 1000 T_F the
    backward waits for its stash and the iteration gets longer (the limit still holds)."""
    for bandwidth, slower in ((4.0, False), (0.001, True)):
        costs = on_one_node(4, bandwidth)
        plain = simulate(*_lp(lowered("1f1b", 4, 8, costs)), costs)
        c = insert_evictions(lowered("1f1b", 4, 8, costs), costs, 3)
        sim = simulate(c.layout, c.programs, costs)
        verify(c, costs, [r.peak_activations for r in sim.ranks], 3)
        assert (sim.makespan > plain.makespan) is slower


def _lp(compiled):
    return compiled.layout, compiled.programs


def test_infeasible_limit_is_one_line_naming_the_smallest(capsys):
    from tests.test_cli import cli_run

    assert (
        cli_run("simulate", "-s", "1f1b", "-p", "8", "-m", "32", "--evict", "--memory-limit", "4")
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "--memory-limit 4 is infeasible with --evict" in err
    assert err.rstrip().endswith("the smallest feasible limit is 5")


@pytest.mark.parametrize("p, m", [(4, 8), (8, 16)])
def test_golden_1f1b_evict(p, m, golden):
    result = compile_schedule("1f1b", p, m, evict=True)
    assert result.plan["memory_limit"] == math.ceil((p + 1) / 2)
    files = render_files(result)
    text = "".join(files[f"rank_{r:03d}.pipe"] for r in range(result.compiled.world))
    golden(f"1f1b_p{p}_m{m}_evict.pipe", text)


def test_a_tampered_evict_build_fails_verification_at_the_move(tmp_path, capsys):
    from tests.test_cli import cli_run

    out = tmp_path / "b"
    assert cli_run("compile", "-s", "1f1b", "-p", "4", "-m", "8", "--evict", "-o", str(out)) == 0
    assert cli_run("verify", str(out)) == 0
    f = out / "rank_003.pipe"
    f.write_text(f.read_text().replace("RETURN s=0 mb=2 to=0\n", ""))
    capsys.readouterr()
    assert cli_run("verify", str(out)) == 2
    assert "rank 0, instruction 17 (LOAD s=0 mb=2 from=3) waits" in capsys.readouterr().err
