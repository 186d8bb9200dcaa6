"""Codegen: print what the passes decided. Same input, byte-identical output.

Templates (jinja2) render the rank programs and the SVG Gantt chart; JSON outputs are
serialised with sorted keys. Nothing here chooses an order, a rank or a time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cache

import jinja2

from passes.simulate import SimResult, Slot
from pipec.ir import Op, Program
from pipec.textform import TITLE, Header

#: Milliseconds of cost-model time per microsecond of trace time: costs are read as ms.
TRACE_US_PER_UNIT = 1000.0
SVG_WIDTH = 1200.0
ROW_HEIGHT = 22
LEFT = 70
MEMORY_COLUMN = 190  # right of the chart: each rank's peak, in stashes (and bytes with a model)
#: Above this many ops the SVG is drawn per pixel column: boxes would be narrower than a pixel,
#: and 10^5 of them (p=64, m=1024) took longer to print than the programs took to compile.
SVG_MAX_BOXES = 20_000
_OP_NAME = {op: op.name for op in Op}  # Enum's .name is a slow descriptor; 10^5 slots print


@cache
def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("codegen", "templates"),
        keep_trailing_newline=False,
        trim_blocks=False,
        undefined=jinja2.StrictUndefined,
        autoescape=False,
    )


def render_program(header: Header, program: Program) -> str:
    """The `.pipe` text of one rank: title, header, one instruction per line."""
    body = "\n".join(map(str, program)) + "\n" if program else ""  # one join, not a loop
    return _env().get_template("rank.pipe.j2").render(title=TITLE, header=str(header), body=body)


def dump_json(data: object) -> str:
    """Canonical JSON: sorted keys, two-space indent, trailing newline."""
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def chrome_trace(
    timeline: Sequence[Sequence[Slot]],
    title: str,
    counters: Sequence[Sequence[tuple[float, Mapping[str, float]]]] = (),
) -> dict:
    """A timeline as a Chrome/Perfetto trace: one thread per rank, times in ms of cost units.

    The simulator's timeline and the runtime's measured one print the same way; `counters`
    (per rank: (time, {series: bytes}) points) adds a memory track per rank.
    """
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": title}}
    ]
    for rank, slots in enumerate(timeline):
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": 0,
                "tid": rank,
                "args": {"name": f"rank {rank}"},
            }
        )
        for slot in slots:
            events.append(
                {
                    "name": str(slot.instr),
                    "cat": slot.instr.op.value,
                    "ph": "X",
                    "pid": 0,
                    "tid": rank,
                    "ts": round(slot.start * TRACE_US_PER_UNIT, 3),
                    "dur": round((slot.end - slot.start) * TRACE_US_PER_UNIT, 3),
                    "args": {"stage": slot.instr.stage, "mb": slot.instr.mb},
                }
            )
    for rank, points in enumerate(counters):
        for t, series in points:
            events.append(
                {
                    "name": f"memory rank {rank}",
                    "ph": "C",
                    "pid": 0,
                    "tid": rank,
                    "ts": round(t * TRACE_US_PER_UNIT, 3),
                    "args": dict(series),
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def trace_json(timeline: Sequence[Sequence[Slot]], title: str) -> str:
    """`chrome_trace(timeline, title)` as JSON, printed event by event: a compile's timeline
    holds 10^5 slots, and a dict per slot made up half of emit's time. Times print with
    three decimals ("%.3f": no round() and repr() per number), the same values that
    chrome_trace rounds to."""
    meta = chrome_trace([() for _ in timeline], title)["traceEvents"]  # names, no slots
    parts = [json.dumps(meta[0])]
    scale = TRACE_US_PER_UNIT
    for rank, slots in enumerate(timeline):
        parts.append(json.dumps(meta[rank + 1]))
        event = (  # a compute op always has a stage and a micro-batch (invariant 1)
            '{"name": "%s", "cat": "%s", "ph": "X", "pid": 0, "tid": '
            + str(rank)
            + ', "ts": %.3f, "dur": %.3f, "args": {"stage": %d, "mb": %d}}'
        )
        parts.extend(
            event % (i, _OP_NAME[i.op], a * scale, (b - a) * scale, i.stage, i.mb)
            for i, a, b in slots
        )
    return f'{{"traceEvents": [{", ".join(parts)}], "displayTimeUnit": "ms"}}'


def render_svg(sim: SimResult, title: str) -> str:
    """A Gantt chart: ranks down, time across, F/B/W colours, micro-batch labels.

    Above SVG_MAX_BOXES ops the chart is drawn per pixel column (see `_pixel_boxes`).
    """
    scale = (SVG_WIDTH - LEFT - 10) / sim.makespan if sim.makespan > 0 else 1.0
    top, h = 24, ROW_HEIGHT - 4
    n_ops = sum(len(slots) for slots in sim.timeline)
    per_pixel = n_ops > SVG_MAX_BOXES
    if per_pixel:
        title += (
            f" ({n_ops} ops, drawn per pixel column: its busiest op kind; "
            "timeline.json has each op)"
        )
    boxes = []
    for rank, slots in enumerate(sim.timeline):
        y = top + rank * ROW_HEIGHT
        boxes += (_pixel_boxes if per_pixel else _op_boxes)(slots, y, h, scale)
    rows = [(f"rank {r}", top + r * ROW_HEIGHT + h // 2 + 4) for r in range(len(sim.timeline))]
    peaks = [
        f"peak {r.peak_activations:.4g} stashes"
        + ("" if r.peak_stash_bytes is None else f" = {format_bytes(r.peak_stash_bytes)}")
        for r in sim.ranks
    ]
    kinds = sorted({_OP_NAME[s.instr.op] for slots in sim.timeline for s in slots})
    height = top + len(sim.timeline) * ROW_HEIGHT + 22
    return (
        _env()
        .get_template("schedule.svg.j2")
        .render(
            width=int(SVG_WIDTH) + MEMORY_COLUMN,
            height=height,
            title=title,
            rows=rows,
            boxes=boxes,
            legend=[(k, LEFT + 60 * i) for i, k in enumerate(kinds)],
            memory=[(text, y) for text, (_, y) in zip(peaks, rows)],
            memory_x=int(SVG_WIDTH) + 4,
        )
    )


def _op_boxes(slots: Sequence[Slot], y: int, h: int, scale: float) -> list[str]:
    """One box per op, with its instruction and times as a tooltip and its micro-batch label."""
    boxes = []  # one preformatted line per op
    text_y, tail = y + h // 2 + 4, f'" y="{y}" width="'
    for instr, start, end in slots:
        w = (end - start) * scale
        x = LEFT + start * scale
        box = (
            f'<rect class="{_OP_NAME[instr.op]}" x="{x:.2f}{tail}{w:.2f}" '
            f'height="{h}"><title>{instr} [{start:g}, {end:g})</title></rect>'
        )
        label = str(instr.mb)
        if w >= 7 * len(label) + 2:
            box += f'<text class="l" x="{x + w / 2:.2f}" y="{text_y}">{label}</text>'
        boxes.append(box)
    return boxes


def _pixel_boxes(slots: Sequence[Slot], y: int, h: int, scale: float) -> list[str]:
    """One box per run of pixel columns in which the rank spends most time on one op kind.

    Past SVG_MAX_BOXES ops, ops are narrower than a pixel (an F is 0.4 px at p=64, m=1024), so
    this is what the chart can show; an op counts in the column of its middle, or, when wider
    than a pixel, in every column it covers.
    """
    columns = int(SVG_WIDTH)
    busy: dict[str, list[float]] = {}  # op kind -> time in each pixel column
    for instr, start, end in slots:
        x0, w = start * scale, (end - start) * scale
        kind = _OP_NAME[instr.op]
        row = busy.get(kind)
        if row is None:
            row = busy[kind] = [0.0] * (columns + 2)
        if w <= 1:
            row[int(x0 + w / 2)] += w
            continue
        for c in range(int(x0), int(x0 + w) + 1):
            row[c] += w
    best: dict[int, tuple[float, str]] = {}
    for kind in sorted(busy):  # a tie goes to the kind last in name order
        for c, t in enumerate(busy[kind]):
            if t > 0 and (c not in best or t >= best[c][0]):
                best[c] = (t, kind)
    boxes, run = [], None  # run: [first column, last column, kind]
    for c in sorted(best):
        kind = best[c][1]
        if run is not None and run[1] == c - 1 and run[2] == kind:
            run[1] = c
            continue
        if run is not None:
            boxes.append(_pixel_run(run, y, h))
        run = [c, c, kind]
    if run is not None:
        boxes.append(_pixel_run(run, y, h))
    return boxes


def _pixel_run(run: list, y: int, h: int) -> str:
    first, last, kind = run
    width = last - first + 1
    return f'<rect class="{kind}" x="{LEFT + first}" y="{y}" width="{width}" height="{h}"/>'


def format_bytes(n: float) -> str:
    """Bytes in binary units, three significant digits: 529152 -> '517 KiB'."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    k = 0
    while abs(n) >= 1024 and k < len(units) - 1:
        n, k = n / 1024, k + 1
    return f"{n:.0f} B" if k == 0 else f"{n:.3g} {units[k]}"


def render_launch(facts: dict) -> str:
    """OUT/launch.py: the torchrun entry point of a build with a model (see the template)."""
    return _env().get_template("launch.py.j2").render(**facts) + "\n"


def terminal_gantt(sim: SimResult, width: int = 100) -> str:
    """A text Gantt chart: one row per rank, a letter per op kind, '.' where the rank idles."""
    letters = {"F": "F", "B": "B", "W": "W", "BW": "X", "RECOMPUTE": "R"}
    cols = max(10, width)
    scale = cols / sim.makespan if sim.makespan > 0 else 1.0
    lines = []
    for rank, slots in enumerate(sim.timeline):
        row = ["."] * cols
        for slot in slots:
            a = int(slot.start * scale)
            b = max(a + 1, int(slot.end * scale))
            for c in range(a, min(b, cols)):
                row[c] = letters.get(slot.instr.op.value, "?")
        lines.append(f"rank {rank:>3} |{''.join(row)}|")
    legend = "F forward, B input-grad backward, W weight-grad, X fused B+W, R recompute, . idle"
    end = f"{sim.makespan:g}"
    return "\n".join(lines + [f"{'':9}0{'':{cols - 1 - len(end)}}{end}", legend])


def measured_table(stats: dict) -> str:
    """A run's measured figures beside the simulated ones (runtime/measure.py's stats.json).

    Memory: the real peak (the meter's bytes, runtime/meter.py) and the stash counter's peak
    (the bytes the runtime books for stashes) beside the simulator's stash peak."""
    m, s = stats["measured"], stats["simulated"]
    ratio = m["makespan_ms"] / s["makespan_ms"] if s["makespan_ms"] > 0 else float("inf")
    lines = [
        f"measured over {stats['steps_measured']} steps (median) vs simulated "
        + f"({s['cost_source']} costs):",
        f"  makespan {m['makespan_ms']:.2f} ms vs {s['makespan_ms']:.2f} ms (x{ratio:.2f}); "
        + f"iteration {m['iteration_ms']:.2f} ms",
        f"  bubble   {m['bubble']:.3f} measured vs {s['bubble']:.3f} simulated",
        f"  {'rank':>4}  {'real peak':>10}  {'stash counter':>13}  {'sim stash':>10}  "
        + f"{'busy ms':>8}  {'sim busy':>8}  {'overhead/instr':>14}",
    ]
    for r in stats["ranks"]:
        sim_peak = r["simulated_peak_stash_bytes"]
        lines.append(
            f"  {r['rank']:>4}  {format_bytes(r['real_peak_bytes']):>10}  "
            f"{format_bytes(r['peak_stash_bytes']):>13}  "
            f"{format_bytes(sim_peak) if sim_peak is not None else '-':>10}  "
            f"{r['busy_ms']:>8.2f}  {r['simulated_busy_ms']:>8.2f}  "
            f"{r['overhead_us_per_instruction']:>11.1f} us"
        )
    return "\n".join(lines)


def bytes_table(rows: Sequence[Mapping]) -> str:
    """Per rank, the predicted peak bytes (passes/memory_bytes.py), by term, beside the real
    peak a run measured and their ratio (`pipec show`'s memory table)."""
    terms = ("params", "optimizer", "grads", "stash", "buffers", "held", "host")
    lines = [
        "peak bytes per rank, predicted (by term) vs measured real:",
        f"  {'rank':>4}  {'predicted':>10}  {'real':>10}  {'real/pred':>9}  "
        + "  ".join(f"{t:>9}" for t in terms),
    ]
    for row in rows:
        real = row.get("real_peak_bytes")
        ratio = f"{row['ratio']:.3f}" if real is not None else "-"
        lines.append(
            f"  {row['rank']:>4}  {format_bytes(row['predicted_peak_bytes']):>10}  "
            f"{format_bytes(real) if real is not None else '-':>10}  {ratio:>9}  "
            + "  ".join(f"{format_bytes(row['predicted'][t]):>9}" for t in terms)
        )
    return "\n".join(lines)
