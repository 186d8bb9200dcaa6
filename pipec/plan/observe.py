"""A finished run of a plan's build, read as a calibration observation (`--calibrate BUILD`).

The run wrote BUILD/measured/stats.json (runtime/measure.py): every compute op kind's median
duration per stage, each rank's own time per instruction and optimizer step, each step's
iteration time. Beside them go the block profile's prices for the same chunks at the build's
micro-batch size, so that pipec/plan/calibration.py can take their ratio. The build must cut
the model into the chunks the profile prices (a build `pipec plan` or `pipec compile
--plan-profile` made for this model) at a profiled micro-batch size.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from pipec.build_dir import MEASURED, Build, load
from pipec.ir import Op, PipecError
from pipec.passes.memory_bytes import held_chunks
from pipec.plan.calibration import KIND_OF, Observed
from pipec.plan.candidates import is_recompute_variant
from pipec.plan.conditions import Conditions
from pipec.plan.facts import Chunks, ModelProfile

MS = 1e3


def read_run(path: Path) -> tuple[Build, dict]:
    """The build and its run's stats from BUILD (or BUILD/measured); PipecError otherwise."""
    path = Path(path)
    if path.name == MEASURED and not (path / "plan.json").is_file():
        path = path.parent
    stats_file = path / MEASURED / "stats.json"
    build = load(path)
    if not stats_file.is_file():
        raise PipecError(f"--calibrate {path}: no {MEASURED}/stats.json; run it first (pipec run)")
    try:
        stats = json.loads(stats_file.read_text())
    except ValueError as e:
        raise PipecError(f"--calibrate {stats_file}: not JSON ({e})") from None
    if "ops" not in stats:
        raise PipecError(
            f"--calibrate {path}: its run recorded no op durations (an older pipec); run it again"
        )
    return build, stats


def merge_turns(turns: list[dict]) -> dict:
    """One run's stats from several turns of it (pipec/plan/calibrate_worker.py): each op's
    and each rank's figures the median of the turns', every turn's kept steps, and each
    turn's median iteration time (`turn_ms`)."""

    def median(rows: list[dict], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    ops = {}
    for t in turns:
        for op in t["ops"]:
            ops.setdefault((op["op"], op["stage"]), []).append(op)
    ranks = []
    for rows in zip(*(t["ranks"] for t in turns)):
        own = {k: median(list(rows), k) for k in ("own_us_per_instruction", "optimizer_ms")}
        ranks.append(rows[0] | own)
    return turns[0] | {
        "ops": [
            {"op": op, "stage": stage, "ms": median(rows, "ms"), "count": len(rows)}
            for (op, stage), rows in sorted(ops.items())
        ],
        "ranks": ranks,
        "per_step": [step for t in turns for step in t["per_step"]],
        "turn_ms": [median(t["per_step"], "iteration_ms") for t in turns],
    }


def run_conditions(stats: dict) -> Conditions | None:
    """The conditions a run recorded (runtime/loop.py), if any."""
    return Conditions.from_json(stats["conditions"]) if stats.get("conditions") else None


def _chunks(raw: ModelProfile, build: Build, source: str) -> tuple[int, Chunks]:
    """The build's micro-batch size and the profile's chunks for its layout; PipecError when
    the build is not cut as the profile prices it."""
    model = build.plan.get("model") or {}
    mbs = model.get("micro_batch_size")
    if mbs not in raw.sizes:
        raise PipecError(
            f"--calibrate {source}: its micro-batch size {mbs} was not profiled "
            f"(profiled: {', '.join(map(str, raw.sizes))}); add it to --mbs"
        )
    layout = build.compiled.layout
    chunks = raw.chunks(layout.n_chunks, mbs)
    blocks = (model.get("partition") or {}).get("blocks_per_stage", [])
    cut = [0] * layout.n_chunks
    for stage, n in enumerate(blocks):
        cut[layout.stage_chunk[stage]] = n
    if tuple(cut) != chunks.counts:
        raise PipecError(
            f"--calibrate {source}: the build cuts the model into chunks of {cut} blocks, the "
            f"profile of {raw.name} into {list(chunks.counts)}; fold runs of builds that "
            "pipec plan made for this model"
        )
    return mbs, chunks


def observe(raw: ModelProfile, build: Build, stats: dict, source: str) -> Observed:
    """What the run of `build` measured beside what `raw` prices for the same ops."""
    mbs, chunks = _chunks(raw, build, source)
    layout = build.compiled.layout
    sums: dict[str, list[float]] = {}
    for op in stats["ops"]:
        kind, chunk = KIND_OF[Op(op["op"])], layout.stage_chunk[op["stage"]]
        c = chunks.seconds[chunk]
        if kind == "BW":
            priced = chunks.fused_backward[chunk] if chunks.fused_backward else c.B + c.W
        else:
            priced = getattr(c, kind)
        pair = sums.setdefault(kind, [0.0, 0.0])
        pair[0] += op["ms"] / MS
        pair[1] += priced
    p = build.compiled.p
    ranks = [r for r in stats["ranks"] if r["rank"] < p]  # one data-parallel copy
    optimizer = (
        sum(r.get("optimizer_ms", 0.0) for r in ranks) / MS,
        sum(chunks.optimizer_s[c] for r in range(p) for c in held_chunks(layout, r))
        if chunks.optimizer_s
        else 0.0,
    )
    own = [r["own_us_per_instruction"] / 1e6 for r in ranks if "own_us_per_instruction" in r]
    schedule = build.plan["schedule"]
    strategy = "evict" if build.plan.get("evict") else "plain"
    if is_recompute_variant(schedule):
        strategy = "recompute"
    return Observed(
        source=source,
        family=f"{schedule} {strategy}",
        mbs=mbs,
        kinds=tuple((k, m, pr) for k, (m, pr) in sorted(sums.items())),
        optimizer=optimizer,
        instr_s=statistics.median(own) if own else 0.0,
        iterations=tuple(s["iteration_ms"] / MS for s in stats["per_step"]),
        turns=tuple(ms / MS for ms in stats.get("turn_ms", ())),
        precision=stats.get("precision", "fp32"),
        compiled=build.compiled,
    )
