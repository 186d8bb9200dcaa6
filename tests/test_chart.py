"""The Gantt chart (OUT/schedule.svg) and the figures beside it say what they show: makespan,
bubble, the time axis and its unit, chunks, directions, stash moves and live stash per rank."""

import re

import pytest

from pipec.build_dir import ESTIMATE_NOTE, chart_facts, time_unit
from pipec.codegen import render
from pipec.codegen.render import measured_table, render_svg
from pipec.passes.stash_timeline import stash_over_time
from tests.helpers import run
from tests.test_cli import ROOT, cli_run


def svg_of(result) -> str:
    return render_svg(result.sim, "t", chart_facts(result))


def box_classes(svg: str) -> list[str]:
    """The class of every op box (boxes carry their instruction as a tooltip)."""
    return re.findall(r'<rect class="([\w ]+)" x="[\d.]+" y="\d+" width="[\d.]+" height="18">', svg)


def legend(svg: str) -> list[str]:
    return re.findall(
        r'<rect class="[\w ]+" x="\d+" y="\d+" width="10" height="10"/><text '
        r'x="\d+" y="\d+">([^<]+)</text>',
        svg,
    )


@pytest.mark.parametrize(
    "name, p, m, kw",
    [
        ("1f1b", 4, 8, {}),
        ("1f1b-r", 4, 8, {}),
        ("zb-h1", 4, 8, {"costs": "F=1,B=1,W=1,comm=0.2"}),
        ("interleaved", 4, 8, {"v": 2}),
        ("zb-v", 4, 8, {}),
        ("bitpipe", 4, 8, {}),
        ("dualpipe", 4, 8, {}),
        ("1f1b", 4, 8, {"evict": True, "memory_limit": 3}),
        ("zb-v", 4, 8, {"evict": True}),
    ],
)
def test_stash_strip_reaches_each_ranks_peak_and_returns_to_zero(name, p, m, kw):
    """The series are the simulator's counts on the timeline: each rank's highest value is
    its reported peak, an iteration ends with nothing stashed, and time never goes back."""
    result = run(name, p, m, **kw)
    c = result.compiled
    series = stash_over_time(c.layout, c.programs, result.costs, result.sim)
    for (times, lives), stats in zip(series, result.sim.ranks):
        assert max(lives) == pytest.approx(stats.peak_activations)
        assert lives[-1] == pytest.approx(0, abs=1e-9)
        assert times == sorted(times)
        assert 0 <= times[0] and times[-1] <= result.sim.makespan
    svg = svg_of(result)
    peak_all = max([r.peak_activations for r in result.sim.ranks] + [kw.get("memory_limit", 0)])
    strips = re.findall(r'<path class="mem" [^>]* d="M70 0([^"]*)Z"/>', svg)
    assert len(strips) == p
    for path, stats in zip(strips, result.sim.ranks):
        highest = -min(int(v) for v in re.findall(r"V(-?\d+)", path))  # in tenths of a pixel
        assert highest == round(10 * render.STRIP_HEIGHT * stats.peak_activations / peak_all)


def test_title_axis_and_legend_of_1f1b():
    result = run("1f1b", 4, 8)
    svg = svg_of(result)
    assert "t: makespan 33, bubble 27.3 %</text>" in svg
    ticks = re.findall(r'<text class="t" x="([\d.]+)" y="\d+">(\d+)</text>', svg)
    assert [label for _, label in ticks] == ["0", "5", "10", "15", "20", "25", "30"]
    scale = (render.SVG_WIDTH - render.LEFT - 10) / 33
    for x, label in ticks:  # each tick sits at its time
        assert float(x) == pytest.approx(render.LEFT + int(label) * scale, abs=0.01)
    assert "time (in the unit of --costs)" in svg
    assert legend(svg) == [
        "F forward",
        "BW backward: B and W fused",
        "live stash under each rank, full height 4 stashes",
    ]
    assert set(box_classes(svg)) == {"F", "BW"}


def test_chunks_are_shaded_by_the_ranks_chunk():
    """Interleaved v=2: stage s is chunk s // p of its rank; zb-v folds back (V-shape)."""
    for name, chunk_of in (("interleaved", lambda s: s // 4), ("zb-v", lambda s: s // 4)):
        result = run(name, 4, 8, 2)
        svg = svg_of(result)
        shades = re.findall(r'<rect class="(\w+)( c1)?" [^>]*><title>\w+ s=(\d+)', svg)
        assert shades and all((shade == " c1") == (chunk_of(int(s)) == 1) for _, shade, s in shades)
        assert "chunk 1: lighter" in legend(svg)


def test_second_direction_is_hatched():
    """BitPipe: micro-batches 4-7 enter at the last rank; their boxes are hatched."""
    result = run("bitpipe", 4, 8)
    svg = svg_of(result)
    marked = re.findall(r'<rect class="(h?)\w+[ c1]*" [^>]*><title>\w+ s=\d+ mb=(\d+)', svg)
    assert marked and all((hatch == "h") == (int(mb) >= 4) for hatch, mb in marked)
    assert "hatched: the second direction (enters at rank 3)" in legend(svg)
    assert '<pattern id="hF"' in svg and '<pattern id="hBW"' in svg


def test_evictions_are_marked_and_explained():
    result = run("1f1b", 4, 8, evict=True, memory_limit=3)
    svg = svg_of(result)
    evicted = sum(t.kind == "evict" for t in result.sim.transfers)
    assert evicted > 0
    assert svg.count('<path class="EVICT"') == evicted
    assert svg.count('<path class="LOAD"') == evicted
    entries = legend(svg)
    assert "EVICT: a stash leaves for a partner rank" in entries
    assert "LOAD: it comes back" in entries
    assert entries[-1].endswith("limit 3 (dashed)")
    assert svg.count('<line class="limit"') == 4


def test_zero_bubble_legend_explains_b_and_w():
    svg = svg_of(run("zb-h1", 4, 8))
    assert legend(svg)[:3] == [
        "F forward",
        "B backward: input gradient",
        "W backward: weight gradient",
    ]


def test_recompute_is_in_the_legend():
    assert "RECOMPUTE forward recomputed for B" in legend(svg_of(run("1f1b-r", 4, 8)))


def test_model_times_are_in_ms_and_estimates_say_so():
    assert time_unit({"model": None}) == ("", "")
    profiled = {"model": {"cost": {"source": "profile", "flops_per_s": 1e14}}}
    assert time_unit(profiled) == ("ms", "")
    estimated = {"model": {"cost": {"source": "estimate", "flops_per_s": 1e14}}}
    assert time_unit(estimated) == ("ms", ESTIMATE_NOTE.format(tflops=100))
    assert "assumed 100 TFLOP/s" in ESTIMATE_NOTE.format(tflops=100)


def measured_stats(cost_source: str) -> dict:
    """runtime/measure.py's stats.json for a 2-rank run (the fields measured_table reads)."""
    rank = {
        "real_peak_bytes": 4096,
        "peak_stash_bytes": 1024,
        "simulated_peak_stash_bytes": 1024,
        "busy_ms": 50.0,
        "simulated_busy_ms": 0.0012,
        "overhead_us_per_instruction": 3.0,
    }
    return {
        "steps_measured": 3,
        "measured": {
            "makespan_ms": 113.01,
            "iteration_ms": 120.0,
            "bubble": 0.3,
            "replay_ms": 107.6,
            "makespan_over_replay": 1.05,
        },
        "simulated": {"makespan_ms": 0.004775, "bubble": 0.29, "cost_source": cost_source},
        "ranks": [{"rank": r} | rank for r in range(2)],
    }


def test_measured_table_compares_only_like_with_like():
    estimated = measured_table(measured_stats("estimate"))
    assert "makespan 113.01 ms; simulated 0.004775 ms from FLOP estimates" in estimated
    assert "no prediction of this machine" in estimated and "(x" not in estimated
    assert "0.0012" in estimated  # the simulated busy time is not printed as 0.00
    profiled = measured_table(measured_stats("profile"))
    assert "makespan 113.01 ms vs 0.00 ms (x23667.02)" in profiled
    assert "replay   107.60 ms" in profiled and "makespan / replay x1.05" in profiled


def test_a_model_build_prints_ms_and_says_its_costs_are_estimates(tmp_path, capsys):
    out = tmp_path / "b"
    spec = f"{ROOT}/examples/gpt.py:tiny"
    assert cli_run("compile", spec, "-s", "1f1b", "-p", "2", "-m", "2", "-o", str(out)) == 0
    lines = capsys.readouterr().out.splitlines()
    wrote, note = lines[0], lines[-1]  # the partition's lines between them
    assert re.search(r"makespan [\d.e-]+ ms, bubble", wrote)
    assert note == f"note: {ESTIMATE_NOTE.format(tflops=100)}"
    assert ESTIMATE_NOTE.format(tflops=100) in (out / "schedule.svg").read_text()
    assert cli_run("show", str(out)) == 0
    shown = capsys.readouterr().out
    assert "(times in ms)" in shown and note in shown.splitlines()
