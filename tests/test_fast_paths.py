"""The compile-speed shortcuts answer exactly what the plain code would (bench/compile_speed.py)."""

import json
import re

import pytest

from pipec.build_dir import chart_facts
from pipec.codegen import render
from pipec.codegen.render import chrome_trace, render_svg, trace_json
from pipec.ir import Instr, Op, op_kinds
from tests.helpers import run


@pytest.mark.parametrize(
    "name, p, m, costs",
    [
        ("1f1b", 4, 8, ""),
        ("zb-h1", 4, 8, "F=18.522,B=18.086,W=9.337,comm=0.601"),
        ("dualpipe", 4, 8, ""),
    ],
)
def test_timeline_json_holds_the_trace_events(name, p, m, costs):
    sim = run(name, p, m, costs=costs).sim
    title = f'{name} "p"={p}'  # a title that JSON must escape
    assert json.loads(trace_json(sim.timeline, title)) == chrome_trace(sim.timeline, title)


def test_large_svg_is_drawn_per_pixel_column(monkeypatch):
    result = run("1f1b", 8, 32)
    sim, facts = result.sim, chart_facts(result)
    n_ops = sum(len(slots) for slots in sim.timeline)
    boxes = re.compile(r'<rect class="(F|BW)" x="[\d.]+" y="(\d+)" width="[\d.]+" height="18"')
    small = render_svg(sim, "t", facts)
    assert len(boxes.findall(small)) == n_ops  # one box per op
    monkeypatch.setattr(render, "SVG_MAX_BOXES", n_ops - 1)
    large = render_svg(sim, "t", facts)
    drawn = boxes.findall(large)
    assert f"{n_ops} ops, drawn per pixel column" in large
    assert 8 <= len(drawn) < n_ops  # at least one run per rank, fewer boxes than ops
    assert {kind for kind, _ in drawn} == {"F", "BW"}
    assert len({y for _, y in drawn}) == 8  # every rank has boxes
    widths = [int(w) for w in re.findall(r'width="(\d+)" height="18"/>', large)]
    assert sum(widths) <= 8 * (render.SVG_WIDTH - render.LEFT)  # no more than the chart holds


def test_op_kinds_follows_mutable_programs_and_keeps_tuples():
    programs = [[Instr(Op.F, 0, 0)], [Instr(Op.BW, 0, 0)]]
    assert op_kinds(programs) == {Op.F, Op.BW}
    programs[1].append(Instr(Op.RECOMPUTE, 0, 0))  # a list may change: never kept
    assert Op.RECOMPUTE in op_kinds(programs)
    frozen = tuple(tuple(prog) for prog in programs)
    assert op_kinds(frozen) is op_kinds(frozen)
    assert op_kinds(frozen) == {Op.F, Op.BW, Op.RECOMPUTE}


def test_a_send_before_its_producer_is_caught():
    from dataclasses import replace

    from pipec.passes.execution import check_execution
    from pipec.passes.verify import VerifyError

    compiled = run("1f1b", 2, 2).compiled
    first = compiled.programs[0]
    send = next(i for i in first if i.op is Op.SEND_ACT)
    moved = (send,) + tuple(i for i in first if i is not send)  # rank 0 sends before its F
    broken = replace(compiled, programs=(moved, *compiled.programs[1:]))
    with pytest.raises(
        VerifyError, match=r"rank 0, instruction 0 \(SEND_ACT s=0 mb=0 to=1\): sends what"
    ):
        check_execution(broken)


@pytest.mark.parametrize("stage", [99, None])
def test_execution_alone_refuses_a_stage_the_layout_lacks(stage):
    from dataclasses import replace

    from pipec.passes.execution import check_execution
    from pipec.passes.verify import VerifyError

    compiled = run("1f1b", 2, 2).compiled
    first = (Instr(Op.F, stage, 0), *compiled.programs[0])
    broken = replace(compiled, programs=(first, *compiled.programs[1:]))
    with pytest.raises(VerifyError, match=r"rank 0, instruction 0 .*: not an op of the work graph"):
        check_execution(broken)
