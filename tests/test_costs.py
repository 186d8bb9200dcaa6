"""What a cost means: one rank's share of the model by default, each chunk's op its part; per
chunk op with `per=chunk`, and for a model's measured stages, never divided again."""

import json
from pathlib import Path

import pytest
from plan_synthetic import synthetic_profile

from pipec.compile import compile_schedule
from pipec.ir import PipecError
from pipec.model import MS_PER_S, compile_model
from pipec.passes.costs import CostModel, parse_costs
from pipec.passes.registry import SCHEDULES, Request, family
from pipec.plan.candidates import price
from tests.helpers import CHUNK_UNITS, peaks, run
from tests.test_cli import cli_run
from tests.test_cli_guards import SHAPE, one_line_error

family("1f1b")  # registers the built-in families
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("p, m", [(2, 4), (3, 6), (4, 8), (8, 16)])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_does_1f1bs_work_at_the_same_costs(p, m, v):
    """At 1F1B's costs every rank of interleaved 1F1B is as busy as 1F1B's ranks, and its
    bubble is 1F1B's divided by v: makespan m(F+B+W) + (p-1)(F+B+W)/v (Megatron's figure)."""
    onef, inter = run("1f1b", p, m), run("interleaved", p, m, v)
    assert [s.busy for s in inter.sim.ranks] == pytest.approx([s.busy for s in onef.sim.ranks])
    assert onef.sim.makespan == 3 * m + 3 * (p - 1)
    assert inter.sim.makespan == pytest.approx(3 * m + 3 * (p - 1) / v)


def test_every_family_keeps_a_rank_as_busy_at_the_default_costs():
    """Whatever the placement (v chunks, a V, two replicas), one micro-batch costs each rank
    F+B+W (a recomputed forward twice over F): the families compare at the same costs."""
    for name in sorted(SCHEDULES):
        r = run(name, 4, 8)
        work = 8 * (4 if name == "1f1b-r" else 3)
        assert [s.busy for s in r.sim.ranks] == pytest.approx([work] * 4), name


def test_the_cli_prints_comparable_makespans(capsys):
    figures = {}
    for name, v in (("1f1b", "1"), ("interleaved", "2")):
        assert cli_run("simulate", "-s", name, "-p", "4", "-m", "8", "-v", v, "--json") == 0
        figures[name] = json.loads(capsys.readouterr().out)
    assert figures["1f1b"]["makespan"] == 33 and figures["interleaved"]["makespan"] == 28.5
    busy = {name: [r["busy"] for r in f["ranks"]] for name, f in figures.items()}
    assert busy["1f1b"] == busy["interleaved"] == [24] * 4


@pytest.mark.parametrize(
    "name, v, before",
    [("interleaved", 2, 57), ("interleaved", 3, None), ("zb-v", 2, 51), ("bitpipe", 2, 53)],
)
def test_per_chunk_costs_give_the_old_figures(name, v, before):
    """per=chunk reads each value as one chunk op's time: the figures of before (57 for
    interleaved v=2 at p=4, m=8, unit costs), and costs of 1/v per chunk op are the default."""
    per_chunk = run(name, 4, 8, v, costs=CHUNK_UNITS)
    if before is not None:
        assert per_chunk.sim.makespan == before
    same = run(name, 4, 8, v, costs=f"per=chunk,F={1 / v!r},B={1 / v!r},W={1 / v!r}")
    default = run(name, 4, 8, v)
    assert same.sim.makespan == pytest.approx(default.sim.makespan, rel=1e-12)
    assert peaks(per_chunk) == peaks(default)  # memory was a chunk's part already


def test_a_list_weighs_the_chunks_in_the_unit_of_a_single_value():
    """Equal values read as the single value; a heavier chunk takes more in proportion."""
    plain = run("interleaved", 2, 4, 2, costs="F=2,B=2,W=2")
    assert run("interleaved", 2, 4, 2, costs="F=2:2:2:2,B=2,W=2").sim.makespan == (
        plain.sim.makespan
    )
    costs = parse_costs("F=1:1:1:3").of_chunks(0.5)
    assert costs.F == (0.5, 0.5, 0.5, 1.5) and costs.per == "chunk"
    assert costs.of_chunks(0.5) is costs  # per chunk op already: not divided again


def test_comm_is_a_latency_and_allreduce_a_share():
    """comm is never divided; allreduce of a rank's share gives a chunk its part."""
    for name in ("interleaved", "zb-v"):
        share = run(name, 4, 8, 2, costs="F=1,B=2,W=1,comm=0.3")
        chunk = run(name, 4, 8, 2, costs="per=chunk,F=0.5,B=1,W=0.5,comm=0.3")
        assert share.sim.makespan == chunk.sim.makespan
    costs = parse_costs("F=1,allreduce=2,comm=0.5").of_chunks(0.25)
    assert (costs.allreduce, costs.comm) == (0.5, 0.5)


def test_a_plan_holds_costs_per_chunk_op(tmp_path, capsys):
    """plan.json's costs are what the simulator used (no 'per' key, as plans written before),
    and `verify` re-simulates them to the same stats.json."""
    out = tmp_path / "b"
    assert cli_run("compile", "-s", "interleaved", "-p", "4", "-m", "8", "-o", str(out)) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["costs"]["F"] == [0.5] and "per" not in plan["costs"]
    assert json.loads((out / "stats.json").read_text())["makespan"] == 28.5
    assert CostModel.from_json(plan["costs"]).per == "chunk"
    capsys.readouterr()
    assert cli_run("verify", str(out)) == 0
    assert "makespan 28.5" in capsys.readouterr().out


def test_a_share_model_round_trips_through_json():
    costs = parse_costs("per=share,F=2")
    assert costs.to_json()["per"] == "share" and CostModel.from_json(costs.to_json()) == costs
    assert "per" not in parse_costs("per=chunk,F=2").to_json()


def test_a_models_measured_chunks_are_not_divided_again():
    """`pipec plan` prices each chunk by its own measured time: a V rank's busy time is the
    sum of its two chunks' F+B+W over the micro-batches."""
    layout, chunks, costs = price(synthetic_profile(lambda n: 0.5), "v-half", Request(4, 8, 2), 1)
    assert costs.per == "chunk"
    result = compile_schedule("v-half", 4, 8, 2, costs)
    for r, stats in enumerate(result.sim.ranks):
        held = {layout.stage_chunk[s] for s in layout.stages_of_rank(r)}
        work = sum(chunks.seconds[c].F + chunks.seconds[c].B + chunks.seconds[c].W for c in held)
        assert stats.busy == pytest.approx(8 * work, rel=1e-9)


def test_a_model_build_keeps_each_chunks_own_time():
    """The frontend's per-chunk times (ms) are the plan's costs as they are, on a V too."""
    r = compile_model(f"{ROOT}/examples/gpt.py:tiny", "v-half", 2, 4)
    stages = r.plan["model"]["stages"]
    assert r.costs.F == tuple(s["seconds"]["F"] * MS_PER_S for s in stages)
    assert r.plan["costs"]["W"] == [s["seconds"]["W"] * MS_PER_S for s in stages]


def test_the_help_says_what_a_cost_means(capsys):
    assert cli_run("simulate", "--help") == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "one rank's share of the model" in text
    assert "a chunk's op takes its part (1/v with v chunks per rank)" in text
    assert "per=chunk: the values are per chunk op" in text
    assert "comm: one transfer's latency" in text


@pytest.mark.parametrize(
    "costs, message",
    [
        ("per=row", "--costs: cannot read 'per=row'; expected KEY=VALUE"),
        ("per=1", "--costs per=1: give per=share or per=chunk"),
        ("per=chunk,per=share", "--costs gives per twice; give each key once"),
        ("F=chunk", "--costs F: 'chunk' is not a number"),
        ("per=chunk,F=1:2", "--costs F has 2 values; give one, or one per model chunk (4)"),
        ("per=chunk,W=-1", "--costs W must not be negative"),
    ],
)
def test_bad_forms_are_refused_in_one_line(costs, message, capsys):
    assert cli_run("simulate", *SHAPE, "--costs", costs) == 2
    assert message in one_line_error(capsys)


def test_parse_costs_refuses_without_the_cli():
    with pytest.raises(PipecError, match="give per=share or per=chunk"):
        parse_costs("per=2")
