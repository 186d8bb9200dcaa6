"""Codegen: print what the passes decided. Same input, byte-identical output.

Templates (jinja2) render the rank programs and the SVG Gantt chart; JSON outputs are
serialised with sorted keys. Nothing here chooses an order, a rank or a time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from itertools import chain, groupby
from operator import itemgetter

import jinja2

from pipec.ir import Layout, Op, Program
from pipec.passes.memory_bytes import TERMS
from pipec.passes.simulate import SimResult, Slot
from pipec.passes.transfers import Transfer
from pipec.textform import TITLE, Header

#: Milliseconds of cost-model time per microsecond of trace time: costs are read as ms.
TRACE_US_PER_UNIT = 1000.0
SVG_WIDTH = 1200.0
TOP = 30  # below the title line (and one line per note under it)
BOX_HEIGHT = 18
STRIP_HEIGHT = 14  # each rank's live-stash strip, under its boxes
ROW_HEIGHT = BOX_HEIGHT + STRIP_HEIGHT + 10
LEFT = 70
MEMORY_COLUMN = 190  # right of the chart: each rank's peak, in stashes (and bytes with a model)
#: Above this many ops the SVG is drawn per pixel column: boxes would be narrower than a pixel,
#: and 10^5 of them (p=64, m=1024) took longer to print than the programs took to compile.
SVG_MAX_BOXES = 20_000
_OP_NAME = {op: op.name for op in Op}  # Enum's .name is a slow descriptor; 10^5 slots print


@cache
def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("pipec.codegen", "templates"),
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


@dataclass(frozen=True)
class ChartFacts:
    """What the Gantt chart prints besides the timeline: the layout (which chunk and which
    direction each stage is), each rank's live stash over time (`passes/stash_timeline.py`),
    the unit of time, a note under the title, and the memory limit, if any (in stashes)."""

    layout: Layout
    memory: Sequence[tuple[Sequence[float], Sequence[float]]]
    unit: str = ""
    """'ms' for a model build; empty for schedule studies, whose costs have the user's unit."""
    note: str = ""
    memory_limit: float | None = None


#: What each op kind's colour stands for, in the legend.
_MEANING = {
    "F": "forward",
    "B": "backward: input gradient",
    "W": "backward: weight gradient",
    "BW": "backward: B and W fused",
    "RECOMPUTE": "forward recomputed for B",
}


def render_svg(sim: SimResult, title: str, facts: ChartFacts) -> str:
    """A Gantt chart a person reads at a glance: ranks down, time across on an axis with its
    unit; colour by op kind, shade by the rank's chunk, hatching for the second direction of
    a bidirectional schedule, the micro-batch in each box; under each rank a strip of its
    live stash over time (EVICT/LOAD marked on it); makespan and bubble in the title; a
    legend for everything shown. Above SVG_MAX_BOXES ops the boxes are drawn per pixel column
    (see `_pixel_boxes`) and show op kinds only."""
    layout, p = facts.layout, len(sim.timeline)
    chart_w = SVG_WIDTH - LEFT - 10
    scale = chart_w / sim.makespan if sim.makespan > 0 else 1.0
    n_ops = sum(len(slots) for slots in sim.timeline)
    per_pixel = n_ops > SVG_MAX_BOXES
    unit = f" {facts.unit}" if facts.unit else ""
    head = f"{title}: makespan {sim.makespan:.4g}{unit}, bubble {sim.bubble * 100:.1f} %"
    notes = [facts.note] if facts.note else []
    if per_pixel:
        notes.append(
            f"{n_ops} ops, drawn per pixel column (its busiest op kind); timeline.json has each op"
        )
    top = TOP + 14 * len(notes)
    classes = _box_classes(layout)
    boxes, rows, strips, marks = [], [], [], []
    peak_all = max([r.peak_activations for r in sim.ranks] + [facts.memory_limit or 0.0])
    strip_ys = [top + r * ROW_HEIGHT + BOX_HEIGHT + 2 for r in range(p)]
    for rank, slots in enumerate(sim.timeline):
        y = top + rank * ROW_HEIGHT
        if per_pixel:
            boxes += _pixel_boxes(slots, y, BOX_HEIGHT, scale)
        else:
            boxes += _op_boxes(slots, y, BOX_HEIGHT, scale, classes)
        rows.append((f"rank {rank}", y + BOX_HEIGHT // 2 + 4))
        times, lives = facts.memory[rank]
        strips.append(_strip(times, lives, strip_ys[rank], scale, peak_all))
    if not per_pixel:
        for t in sim.transfers:  # on the evictor's strip: the rank whose stash moves
            rank = t.src if t.kind == "evict" else t.dst
            marks.append(_transfer_mark(t, LEFT + t.start * scale, strip_ys[rank]))
    peaks = [
        (
            f"peak {r.peak_activations:.4g} stashes"
            + ("" if r.peak_stash_bytes is None else f" = {format_bytes(r.peak_stash_bytes)}"),
            top + k * ROW_HEIGHT + BOX_HEIGHT + STRIP_HEIGHT,
        )
        for k, r in enumerate(sim.ranks)
    ]
    axis_y = top + p * ROW_HEIGHT
    ticks = [(LEFT + t * scale, f"{t:g}") for t in _ticks(sim.makespan)]
    limit_y = None
    if facts.memory_limit is not None and peak_all > 0:
        limit_y = STRIP_HEIGHT - facts.memory_limit / peak_all * STRIP_HEIGHT
    legend, height = _legend(sim, layout, per_pixel, peak_all, facts, axis_y + 40)
    return (
        _env()
        .get_template("schedule.svg.j2")
        .render(
            width=int(SVG_WIDTH) + MEMORY_COLUMN,
            height=height,
            head=head,
            notes=[(text, TOP - 2 + 14 * k) for k, text in enumerate(notes)],
            rows=rows,
            boxes=boxes,
            strips=strips,
            marks=marks,
            strip_x=LEFT,
            strip_w=f"{chart_w:.2f}",
            strip_h=STRIP_HEIGHT,
            strip_ys=strip_ys,
            limit_y=None if limit_y is None else f"{limit_y:.2f}",
            peaks=peaks,
            memory_x=int(SVG_WIDTH) + 4,
            axis_y=axis_y,
            axis_end=f"{LEFT + chart_w:.2f}",
            ticks=[(f"{x:.2f}", label) for x, label in ticks],
            axis_label=f"time ({facts.unit or 'in the unit of --costs'})",
            legend=legend,
            hatched=[k for k in _MEANING if len(layout.pipelines) > 1],
        )
    )


def _transfer_mark(t: Transfer, x: float, y: int) -> str:
    """A triangle on the evictor's strip where a stash move starts: pointing down for an
    EVICT (the stash leaves), up for a LOAD (it comes back)."""
    kind = t.kind.upper()
    tip, base = (y + 9, y) if t.kind == "evict" else (y, y + 9)
    return (
        f'<path class="{kind}" d="M{x - 5:.2f} {base}H{x + 5:.2f}L{x:.2f} {tip}Z">'
        f"<title>{kind} s={t.stage} mb={t.mb} rank {t.src} to {t.dst} "
        f"[{t.start:g}, {t.end:g})</title></path>"
    )


def _chunks_and_directions(layout: Layout) -> tuple[dict[int, int], dict[int, int]]:
    """Per stage, which of its rank's chunks it is in its direction, and that direction."""
    chunk, direction = {}, {}
    for d, pipeline in enumerate(layout.pipelines):
        seen: dict[int, int] = {}
        for s in pipeline.stages:
            r = layout.stage_rank[s]
            chunk[s], direction[s] = seen.get(r, 0), d
            seen[r] = chunk[s] + 1
    return chunk, direction


def _box_classes(layout: Layout) -> dict[Op, list[str]]:
    """Per op kind, each stage's box class: the kind, 'h' before it for the second direction
    of a bidirectional schedule (hatched), ' cK' for the rank's K-th chunk (K > 0, lighter)."""
    chunk, direction = _chunks_and_directions(layout)
    stages = range(layout.n_stages)
    return {
        op: [
            ("h" if direction[s] else "")
            + _OP_NAME[op]
            + (f" c{min(chunk[s], 3)}" if chunk[s] else "")
            for s in stages
        ]
        for op in Op
    }


def _op_boxes(
    slots: Sequence[Slot], y: int, h: int, scale: float, classes: dict[Op, list[str]]
) -> list[str]:
    """One box per op, with its instruction and times as a tooltip and its micro-batch label."""
    boxes = []  # one preformatted line per op
    text_y, tail = y + h // 2 + 4, f'" y="{y}" width="'
    for instr, start, end in slots:
        w = (end - start) * scale
        x = LEFT + start * scale
        box = (
            f'<rect class="{classes[instr.op][instr.stage]}" x="{x:.2f}{tail}{w:.2f}" '
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


def _strip(
    times: Sequence[float], lives: Sequence[float], y: int, scale: float, peak: float
) -> str:
    """A rank's live stash as a filled step path under its boxes, one step per pixel column:
    the highest value in the column, held until the next column with a change.

    Written as maps over C functions and strings printed in advance, with no Python code per
    change: a large chart has 10^5 of them.
    """
    if not times or peak <= 0:
        return ""
    # Consecutive changes in one column: groupby keeps them together, max takes the pair
    # with the highest value (the columns are equal).
    columns = map(int, map(scale.__mul__, times))
    pairs = map(max, map(itemgetter(1), groupby(zip(columns, lives), itemgetter(0))))
    cols, highest = zip(*pairs)
    # Heights in tenths of a pixel up from the strip's bottom (the path is scaled by 0.1).
    tenths = map(round, map((10 * STRIP_HEIGHT / peak).__mul__, highest))
    steps = "".join(
        chain.from_iterable(zip(map(_STEP_X.__getitem__, cols), map(_STEP_Y.__getitem__, tenths)))
    )
    end = LEFT + int(scale * times[-1])
    return (
        f'<path class="mem" transform="translate(0 {y + STRIP_HEIGHT}) scale(1 0.1)" '
        f'd="M{LEFT} 0{steps}H{end}V0Z"/>'
    )


#: The strip path's pieces, printed once: a step to column c, a rise to t tenths of a pixel.
_STEP_X = [f"H{LEFT + c}" for c in range(int(SVG_WIDTH) + 1)]
_STEP_Y = [f"V{-t}" for t in range(10 * STRIP_HEIGHT + 1)]


def _ticks(end: float) -> list[float]:
    """Round tick positions from 0 to `end`: steps of 1, 2 or 5 times a power of ten, about
    ten of them."""
    if end <= 0:
        return [0.0]
    raw = end / 10
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(f * power for f in (1, 2, 5, 10) if f * power >= raw)
    return [round(k * step, 12) for k in range(int(end / step + 1e-9) + 1)]


def _legend(
    sim: SimResult,
    layout: Layout,
    per_pixel: bool,
    peak: float,
    facts: ChartFacts,
    y: int,
) -> tuple[list[tuple[str, str, int, int]], int]:
    """The legend's entries as (swatch class, text, x, y), wrapped into rows, and the chart's
    height below them: only what the chart shows."""
    kinds = {_OP_NAME[s.instr.op] for slots in sim.timeline for s in slots}
    items = [(k, f"{k} {_MEANING[k]}") for k in _MEANING if k in kinds]
    if not per_pixel:
        items.append(("", "number: micro-batch"))
        v = max(_chunks_and_directions(layout)[0].values(), default=0) + 1
        if v > 1:
            items += [("F", "chunk 0 of a rank: dark")]
            items += [(f"F c{min(c, 3)}", f"chunk {c}: lighter") for c in range(1, v)]
        if len(layout.pipelines) > 1:
            entry = layout.stage_rank[layout.pipelines[1].stages[0]]
            items.append(("hF", f"hatched: the second direction (enters at rank {entry})"))
        kinds_moved = sorted({t.kind for t in sim.transfers})
        if "evict" in kinds_moved:
            items.append(("EVICT", "EVICT: a stash leaves for a partner rank"))
        if "load" in kinds_moved:
            items.append(("LOAD", "LOAD: it comes back"))
    limit = f", limit {facts.memory_limit:g} (dashed)" if facts.memory_limit is not None else ""
    items.append(
        ("memswatch", f"live stash under each rank, full height {peak:.4g} stashes{limit}")
    )
    out, x, row_y = [], LEFT, y
    right = SVG_WIDTH + MEMORY_COLUMN - 10
    for cls, text in items:
        w = (14 if cls else 0) + 6 * len(text) + 18
        if x + w > right and x > LEFT:
            x, row_y = LEFT, row_y + 16
        out.append((cls, text, x, row_y))
        x += w
    return out, row_y + 10


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

    Simulated times from estimated costs (FLOPs at an assumed device speed) are no
    prediction of this machine: they are printed, but not compared with the measured ones.
    The replay is what the runtime (and the host) added beyond the ops themselves.
    Memory: the real peak (the meter's bytes, runtime/meter.py) and the stash counter's peak
    (the bytes the runtime books for stashes) beside the simulator's stash peak.
    """
    m, s = stats["measured"], stats["simulated"]
    if s["cost_source"] == "estimate":
        makespan = (
            f"  makespan {m['makespan_ms']:.2f} ms; simulated {s['makespan_ms']:.4g} ms from FLOP "
            "estimates at an assumed device speed, no prediction of this machine (compile with "
            "--profile to compare)"
        )
    else:
        ratio = m["makespan_ms"] / s["makespan_ms"] if s["makespan_ms"] > 0 else float("inf")
        makespan = (
            f"  makespan {m['makespan_ms']:.2f} ms vs {s['makespan_ms']:.2f} ms (x{ratio:.2f})"
        )
    lines = [
        f"measured over {stats['steps_measured']} steps (median) vs simulated "
        + f"({s['cost_source']} costs):",
        f"{makespan}; iteration {m['iteration_ms']:.2f} ms",
        f"  replay   {m['replay_ms']:.2f} ms (the ops' measured times, no wait beyond the "
        + f"latency): makespan / replay x{m['makespan_over_replay']:.2f}",
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
            f"{r['busy_ms']:>8.2f}  {r['simulated_busy_ms']:>8.4g}  "
            f"{r['overhead_us_per_instruction']:>11.1f} us"
        )
    return "\n".join(lines)


#: How far a kind's measured / predicted may be from 1 before `pipec show` names it.
KIND_TOLERANCE = 0.10


def op_kinds_line(ratios: Mapping[str, float]) -> str:
    """The op kinds whose measured durations differ from the build's costs by more than
    `KIND_TOLERANCE`, or that none does (`ratios`: kind -> measured / predicted)."""
    every = ", ".join(f"{k} x{r:.2f}" for k, r in ratios.items())
    off = [k for k, r in ratios.items() if abs(r - 1) > KIND_TOLERANCE]
    if not off:
        within = f"every one within {KIND_TOLERANCE:.0%} of its cost"
        return f"op kinds: {within} ({every} measured / predicted)"
    return (
        f"op kinds off by more than {KIND_TOLERANCE:.0%}: {', '.join(off)} ({every} measured / "
        "predicted); pipec plan --calibrate BUILD folds this run into a plan"
    )


def bytes_table(rows: Sequence[Mapping]) -> str:
    """Per rank, the predicted peak bytes (passes/memory_bytes.py), by term, beside the real
    peak a run measured and their ratio (`pipec show`'s memory table)."""
    ran = any(row.get("real_peak_bytes") is not None for row in rows)
    lines = [
        "peak bytes per rank, predicted (by term) vs measured real:"
        if ran
        else "peak bytes per rank, predicted (by term); a run adds the real peaks:",
        f"  {'rank':>4}  {'predicted':>10}  {'real':>10}  {'real/pred':>9}  "
        + "  ".join(f"{t:>9}" for t in TERMS),
    ]
    for row in rows:
        real = row.get("real_peak_bytes")
        ratio = f"{row['ratio']:.3f}" if real is not None else "-"
        lines.append(
            f"  {row['rank']:>4}  {format_bytes(row['predicted_peak_bytes']):>10}  "
            f"{format_bytes(real) if real is not None else '-':>10}  {ratio:>9}  "
            + "  ".join(f"{format_bytes(row['predicted'][t]):>9}" for t in TERMS)
        )
    return "\n".join(lines)
