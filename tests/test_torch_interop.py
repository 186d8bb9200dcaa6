"""torch's own schedules in pipec, and pipec's CSVs in torch's loader (torch imported, no
process group): imported orders verify and simulate like pipec's schedule of the same name."""

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.pipelining import schedules as torch_schedules

from pipec.compile import compile_schedule
from pipec.interop import compile_torch_class, compile_torch_csv
from pipec.ir import PipecError
from pipec.passes.costs import CostModel, parse_costs
from pipec.passes.registry import SCHEDULES, family
from pipec.passes.to_torch import torch_rows
from pipec.passes.verify import verify
from pipec.torch_csv import write_csv
from pipec.torch_orders import CLASSES
from tests.helpers import peaks, run
from tests.test_cli import cli_run
from tests.test_torch_csv import compute_orders

family("1f1b")  # registers the built-in families

#: Unit costs and the zero-bubble paper's 1.5B model (Table 9 profile, ms), per chunk op as
#: the peers' figures are (bench/torch_orders.py, bench/data/README.md).
COSTS = {
    "unit": CostModel(per="chunk"),
    "1.5B": parse_costs("per=chunk,F=18.522,B=18.086,W=9.337,comm=0.601"),
}
SHAPES = [(4, 8), (8, 24)]


def torch_import(cls: str, p: int, m: int, v: int | None, costs: CostModel = COSTS["unit"]):
    result, _ = compile_torch_class(cls, p, m, v, costs)
    verify(result.compiled, costs, peaks(result))  # compile verified it; check again, explicitly
    return result


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("p, m", [(4, 8), (2, 6), (4, 10)])
def test_every_torch_order_imports_and_verifies(cls, p, m):
    result = torch_import(cls, p, m, None)
    assert result.compiled.schedule == f"torch:{cls}"
    assert (result.compiled.p, result.compiled.m) == (p, m)


@settings(max_examples=25, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 24), v=st.integers(1, 3))
@pytest.mark.parametrize("cls", CLASSES)
def test_torch_refuses_or_pipec_verifies(cls, p, m, v):
    """Whatever order torch builds, pipec verifies; the only failures are torch's own refusals."""
    try:
        torch_import(cls, p, m, v)
    except PipecError as e:
        assert f"torch's {cls} refuses" in str(e) or "runs one stage per rank" in str(e), str(e)


def test_v_orders_get_the_v_placement():
    for cls in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        assert torch_import(cls, 4, 8, 2).compiled.layout.stage_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert torch_import("ScheduleInterleaved1F1B", 4, 8, 2).compiled.layout.stage_rank == (
        0,
        1,
        2,
        3,
        0,
        1,
        2,
        3,
    )


@pytest.mark.parametrize(
    "cls, v, name",
    [
        ("ScheduleGPipe", 1, "gpipe"),
        ("Schedule1F1B", 1, "1f1b"),
        ("ScheduleInterleaved1F1B", 2, "interleaved"),
    ],
)
@pytest.mark.parametrize("p, m", SHAPES)
@pytest.mark.parametrize("costs", sorted(COSTS))
def test_torch_orders_equal_pipecs_own(cls, v, name, p, m, costs):
    """Same per-rank compute order, hence the same makespan, bubbles and peaks."""
    theirs = torch_import(cls, p, m, v, COSTS[costs])
    ours = compile_schedule(name, p, m, v, COSTS[costs])
    assert compute_orders(theirs.compiled.programs) == compute_orders(ours.compiled.programs)
    assert theirs.sim.makespan == ours.sim.makespan
    assert peaks(theirs) == peaks(ours)


def test_1f1b_last_rank_numbering_is_fixed_and_said(capsys):
    """torch 2.13 prints Schedule1F1B's last rank as F1..Fm (docs/interop.md); torch's own validator
    rejects that order; pipec renumbers it, says so, and gets pipec's 1f1b."""
    raw = torch_schedules.Schedule1F1B(_stub(0, 4, 4), 8).pipeline_order
    assert [a.microbatch_index for a in raw[3] if a and a.computation_type.value == "F"] == list(
        range(1, 9)
    )
    with pytest.raises(
        AssertionError,
        match="Full Backward for stage 3, microbatch 0 without first running Forward",
    ):
        torch_schedules._validate_schedule(raw, 4, 4, 8)
    assert cli_run("simulate", "--from-torch", "1F1B", "-p", "4", "-m", "8", "--json") == 0
    captured = capsys.readouterr()
    assert "rank 3's forwards 1..8; renumbered 0..7" in captured.err
    assert '"makespan": 33' in captured.out


#: torch class (with its chunks per rank) against the pipec family that builds that schedule.
#: Families written in other branches are compared as soon as they are registered.
COUNTERPARTS = [
    ("ScheduleInterleavedZeroBubble", 1, "zb-h1"),  # torch's ZB1P at one stage per rank
    ("ScheduleZBVZeroBubble", 2, "zb-v"),
    ("ScheduleDualPipeV", 2, "dualpipev"),
]


@pytest.mark.parametrize("cls, v, name", COUNTERPARTS)
@pytest.mark.parametrize("p, m", SHAPES)
@pytest.mark.parametrize("costs", sorted(COSTS))
def test_pipecs_family_is_never_longer_than_torchs_order(cls, v, name, p, m, costs):
    """pipec's family builds torch's order, or one that is shorter under the given costs at no
    more memory (zb-v keeps the reference's greedy where it beats torch's fixed order); at
    unit costs the two take exactly as long."""
    if name not in SCHEDULES:
        pytest.skip(f"pipec family '{name}' is not registered in this branch")
    theirs = torch_import(cls, p, m, v, COSTS[costs])
    ours = compile_schedule(name, p, m, None, COSTS[costs])
    assert ours.sim.makespan <= theirs.sim.makespan * (1 + 1e-9)
    assert max(peaks(ours)) <= max(peaks(theirs)) + 1e-9
    if costs == "unit":
        assert ours.sim.makespan == theirs.sim.makespan


@pytest.mark.parametrize(
    "cls, p, m, unit, gpt15",
    [
        # makespan at unit costs and at the 1.5B costs; docs/interop.md lists and explains them
        ("ScheduleInterleavedZeroBubble", 4, 8, 51, 826.549),
        ("ScheduleZBVZeroBubble", 4, 8, 51, 798.102),
        ("ScheduleDualPipeV", 4, 8, 51, 824.145),
        ("ScheduleZBVZeroBubble", 8, 24, 151, 2354.502),
        ("ScheduleDualPipeV", 8, 24, 151, 2413.085),
    ],
)
def test_two_chunk_zero_bubble_makespans(cls, p, m, unit, gpt15):
    assert torch_import(cls, p, m, 2).sim.makespan == unit
    assert torch_import(cls, p, m, 2, COSTS["1.5B"]).sim.makespan == pytest.approx(gpt15, abs=1e-9)


def test_zbv_is_zero_bubble_at_one_f1b_memory():
    """torch's ZBV follows the paper's ZB-V: span bubble 0 with equal costs, peak p stashes."""
    for p, m in [(4, 8), (8, 16)]:
        result = torch_import("ScheduleZBVZeroBubble", p, m, 2)
        assert result.sim.span_bubble == 0 and max(peaks(result)) == p


def _stub(stage: int, n_stages: int, p: int) -> SimpleNamespace:
    return SimpleNamespace(
        num_stages=n_stages,
        group_size=p,
        group_rank=0,
        stage_index=stage,
        submod=None,
        stage_index_to_group_rank=None,
    )


_LOWERED = ("F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_torch_loads_pipecs_csv(name, tmp_path):
    """torch's `_PipelineScheduleRuntime._load_csv` accepts pipec's exports (compute-only: torch
    lowers it; with comms: pipec's messages) and finds pipec's stage->rank map; torch's
    dry-run simulator finds no deadlock; its compute order is pipec's."""
    result = run(name, 4, 8)
    c = result.compiled
    try:
        rows = {
            fmt: torch_rows(c, fmt == "compute_comms") for fmt in ("compute_only", "compute_comms")
        }
    except PipecError:
        pytest.skip(f"{name} is not exportable (test_torch_csv checks the refusal)")
    for fmt, r in rows.items():
        path = tmp_path / f"{fmt}.csv"
        path.write_text(write_csv(r), newline="")
        runtime = torch_schedules._PipelineScheduleRuntime([_stub(0, c.layout.n_stages, c.p)], c.m)
        runtime._load_csv(str(path), format=fmt)
        assert runtime.stage_index_to_group_rank == dict(enumerate(c.layout.stage_rank))
        lowered = {
            rank: [a for a in actions if a.computation_type.value in _LOWERED]
            for rank, actions in runtime.pipeline_order_with_comms.items()
        }
        torch_schedules._simulate_comms_compute(
            lowered, runtime.stage_index_to_group_rank.__getitem__, c.layout.n_stages
        )
        compute = [[str(a) for a in acts if a.is_compute_op] for _, acts in sorted(lowered.items())]
        assert compute == [
            [str(cell[0]) for cell in row if cell[0].type in "FBIW"] for row in rows["compute_only"]
        ]


def test_bad_torch_class_and_shape_are_one_line(capsys):
    assert cli_run("simulate", "--from-torch", "ScheduleNope", "-p", "4", "-m", "8") == 2
    err = capsys.readouterr().err
    assert "unknown torch schedule 'ScheduleNope'; valid: ScheduleGPipe, Schedule1F1B" in err
    assert cli_run("simulate", "--from-torch", "ScheduleDualPipeV", "-p", "4", "-m", "4") == 2
    err = capsys.readouterr().err
    assert "torch's ScheduleDualPipeV refuses p=4 m=4 v=2: DualPipeV requires at least" in err
    assert err.count("\n") == 1
    assert cli_run("simulate", "--from-torch", "Schedule1F1B", "-p", "4", "-m", "8", "-v", "2") == 2
    assert "runs one stage per rank; --chunks must be 1" in capsys.readouterr().err


@pytest.mark.parametrize("cls", ["ScheduleInterleaved1F1B", "ScheduleDualPipeV"])
@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
def test_csv_dumped_by_torch_imports_like_the_class(cls, fmt, tmp_path):
    """A CSV written by torch's own `_dump_csv` (idle cells, UNSHARD/RESHARD, REDUCE_GRAD,
    sends and receives, OVERLAP_F_B) imports to the same orders as --from-torch."""
    p, m = 4, 8
    stages = [_stub(i, 2 * p, p) for i in range(2)]
    path = tmp_path / "torch.csv"
    getattr(torch_schedules, cls)(stages, m)._dump_csv(str(path), format=fmt)
    from_csv = compile_torch_csv(path, COSTS["unit"])
    assert from_csv.compiled.schedule == "torch-csv:torch"
    assert from_csv.compiled.programs == torch_import(cls, p, m, 2).compiled.programs


def test_torch_order_compiles_for_a_model():
    """bench/compare_torch.py's pipec side: torch's own order, with the model's plan, stages
    cut for its placement, so both runtimes execute the same order over the same stages."""
    from pathlib import Path

    from pipec.model import compile_model_torch_order

    spec = f"{Path(__file__).resolve().parent.parent}/examples/gpt.py:tiny"
    ours = compile_model_torch_order(spec, "ScheduleZBVZeroBubble", 2, 4)
    plain, _ = compile_torch_class("ScheduleZBVZeroBubble", 2, 4, 2, CostModel())
    assert compute_orders(ours.compiled.programs) == compute_orders(plain.compiled.programs)
    assert len(ours.plan["model"]["stages"]) == 4
    assert ours.costs.F != CostModel().F  # the model's per-chunk estimate, not unit costs
