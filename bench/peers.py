"""pipec against its peers: makespan and peak per (family, p, m, costs, limit), and every row
where pipec is worse.

    python bench/peers.py [--pp 4,6,7,8,16] [--costs unit,1.5B] [--all]

Peers are torch 2.13's `torch.distributed.pipelining` generators, run live (their orders are
imported and simulated by pipec), and the zero-bubble repository's generators, whose figures
are in `bench/data/peer-makespans.jsonl` (measured with pipec's semantics; conventions in
`bench/data/README.md`), with its V-Min/V-Half orders also as pipec rebuilds them (exact on
every reference row) so that they are compared at every p. Costs are per op of one chunk (one
stage of the p·v split) and are given explicitly below, so the table does not depend on a CLI
default.

Each pipec row (family, p, m, costs, limit) is compared with its peers at the same p, m and
costs: a fixed family with the peers that build its schedule (zb-v with torch's ZBV and the
zero-bubble repository's zbv.py, v-half with that repository's 'half', ...); a family that
takes a memory limit (zb-auto, v-adaptive) with every peer of its placement whose peak is
within the limit. pipec is worse when it uses more memory than the peer or takes longer than
it (beyond 1e-9 relative). The summary counts the pairs per family and costs; --all prints
every pair. The exit status is 1 when a row is worse.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pipec.compile import CompileResult, Options, compile_from_schedule, compile_schedule
from pipec.interop import compile_torch_class
from pipec.ir import PipecError
from pipec.passes.costs import CostModel
from pipec.passes.registry import Request
from pipec.passes.schedules.vshape import reference_orders, v_half_slots, v_min_slots, v_schedule

DATA = Path(__file__).resolve().parent / "data" / "peer-makespans.jsonl"
COSTS = {
    "unit": CostModel(F=(1.0,), B=(1.0,), W=(1.0,), comm=0.0, per="chunk"),
    "1.5B": CostModel(F=(18.522,), B=(18.086,), W=(9.337,), comm=0.601, per="chunk"),
}
"""Per op of one chunk (`per="chunk"`: a V or interleaved chunk's op takes the cost as given,
as the reference rows count it); 1.5B is the zero-bubble paper's profile (Table 9)."""
PP = (4, 6, 7, 8, 16)
REL = 1e-9

#: Each pipec family's placement and backward; peers of a limit family share it.
GROUP = {
    "1f1b": "sequential, fused backward",
    "interleaved": "interleaved v=2, fused backward",
    "zb-h1": "sequential, split backward",
    "zb-h2": "sequential, split backward",
    "zb-auto": "sequential, split backward",
    "zb-v": "V, split backward",
    "v-min": "V, split backward",
    "v-half": "V, split backward",
    "v-zb": "V, split backward",
    "v-adaptive": "V, split backward",
    "dualpipev": "V, DualPipe pairs",
}
LIMITED = ("zb-auto", "v-adaptive")
"""Families that take --memory-limit: compared with every peer of their group that fits."""

#: torch class, its chunks per rank, and the pipec families that build its schedule (or one at
#: the same placement and memory).
TORCH = [
    ("Schedule1F1B", 1, ("1f1b",)),
    ("ScheduleInterleaved1F1B", 2, ("interleaved",)),
    ("ScheduleInterleavedZeroBubble", 1, ("zb-h1",)),
    ("ScheduleZBVZeroBubble", 2, ("zb-v", "v-zb")),
    ("ScheduleDualPipeV", 2, ("dualpipev",)),
]
#: The reference file's family names: the pipec family, and its limit in rank shares.
REFERENCE = {
    "1f1b": ("1f1b", None),
    "interleaved v=2": ("interleaved", None),
    "zb-h1": ("zb-h1", None),
    "zb-auto ZB-1P": ("zb-auto", 1),
    "zb-auto ZB-2P": ("zb-auto", 2),
    "zb-v": ("zb-v", None),
    "v-min": ("v-min", None),
    "v-half": ("v-half", None),
    "v-zb": ("v-zb", None),
    "v-adaptive": ("v-adaptive", 0),
    "dualpipev": ("dualpipev", None),
}
"""zb-auto's limits are multiples of p; v-adaptive's (0) is the row's own."""


@dataclass(frozen=True)
class Row:
    """One order's figures: pipec's family, or a peer that is the counterpart of `family`."""

    family: str
    p: int
    m: int
    costs: str
    limit: float | None
    who: str
    makespan: float
    peak: float


@dataclass(frozen=True)
class Pair:
    """A pipec row beside one of its peers."""

    ours: Row
    peer: Row

    @property
    def worse(self) -> bool:
        """More memory than the peer, or (when the peer fits pipec's bound: its limit, or its
        own peak for a fixed family) more time."""
        ours, peer = self.ours, self.peer
        if ours.limit is None and ours.peak > peer.peak + REL:
            return True
        bound = ours.peak if ours.limit is None else ours.limit
        return peer.peak <= bound + REL and ours.makespan > peer.makespan * (1 + REL)

    @property
    def verdict(self) -> str:
        if self.worse:
            return "WORSE"
        return "better" if self.ours.makespan < self.peer.makespan * (1 - REL) else "equal"


def figures(result: CompileResult) -> tuple[float, float]:
    return result.sim.makespan, max(r.peak_activations for r in result.sim.ranks)


def limits(family: str, p: int, extra: set[float]) -> list[float | None]:
    """The limits a family is run at (rank shares): None for a fixed family; zb-auto at p and
    2p (ZB-1P, ZB-2P); v-adaptive at V-Min's, V-Half's, 3p/4 and p, and the reference's."""
    if family == "zb-auto":
        return [float(p), 2.0 * p]
    if family == "v-adaptive":
        return sorted({(p + 4) // 3, (p + 2) // 2, round(1.5 * p) / 2, float(p)} | extra)
    return [None]


def pipec_row(family: str, p: int, m: int, costs: str, limit: float | None) -> Row | None:
    """pipec's figures for one family at (p, m, costs, limit); None (said on stderr) if the
    family refuses the shape."""
    try:
        result = compile_schedule(family, p, m, None, COSTS[costs], limit)
    except PipecError as e:
        print(f"pipec {family} p={p} m={m} limit={limit}: {e}", file=sys.stderr)
        return None
    return Row(family, p, m, costs, limit, "pipec", *figures(result))


def pipec_rows(p: int, m: int, costs: str, extra: set[float] = frozenset()) -> Iterator[Row]:
    """pipec's row of every family at (p, m, costs), at each of its limits."""
    for family in GROUP:
        for limit in limits(family, p, extra if family == "v-adaptive" else set()):
            row = pipec_row(family, p, m, costs, limit)
            if row is not None:
                yield row


def torch_rows(p: int, m: int, costs: str) -> Iterator[Row]:
    """torch's order of every class in TORCH at (p, m), simulated under `costs`."""
    for cls, v, families in TORCH:
        try:
            result, _ = compile_torch_class(cls, p, m, v, COSTS[costs])
        except PipecError as e:
            print(f"torch {cls} p={p} m={m}: {e}", file=sys.stderr)
            continue
        for family in families:
            yield Row(family, p, m, costs, None, f"torch {cls}", *figures(result))


def reproduced_rows(p: int, m: int, costs: str) -> Iterator[Row]:
    """The zero-bubble repository's V-Min and V-Half orders at (p, m), as pipec rebuilds them
    (passes/schedules/vgreedy.py, exact on every reference row): its figures at any p."""
    for name, slots in (("min", v_min_slots), ("half", v_half_slots)):
        sched = v_schedule(f"zbv_greedy {name}", Request(p, m, 2), reference_orders(slots, p, m))
        result = compile_from_schedule(sched, Options(COSTS[costs]))
        yield Row(
            f"v-{name}", p, m, costs, None, f"zb zbv_greedy '{name}' (rebuilt)", *figures(result)
        )


def reference_rows(path: Path = DATA) -> list[Row]:
    """The zero-bubble repository's (and torch's) figures measured into `path`."""
    rows = []
    for line in path.read_text().splitlines():
        d = json.loads(line)
        family, scale = REFERENCE[d["family"]]
        limit = None if scale is None else d["limit"] if scale == 0 else scale * d["p"]
        rows.append(
            Row(family, d["p"], d["m"], d["costs"], limit, d["who"], d["makespan"], d["peak"])
        )
    return rows


def pairs(ours: list[Row], peers: list[Row]) -> list[Pair]:
    """Each pipec row beside the peers it answers to (see the module docstring)."""
    found = []
    for row in ours:
        seen = set()  # a peer listed for two families is one peer of a limit family
        for peer in peers:
            if (peer.p, peer.m, peer.costs) != (row.p, row.m, row.costs):
                continue
            if row.family in LIMITED:
                fits = GROUP[peer.family] == GROUP[row.family] and peer.peak <= row.limit + REL
            else:
                fits = peer.family == row.family
            key = (peer.who, peer.limit, peer.makespan)
            if fits and key not in seen:
                seen.add(key)
                found.append(Pair(row, peer))
    return found


def shapes(pp: list[int]) -> list[tuple[int, int]]:
    return [(p, m) for p in pp for m in (2 * p, 4 * p)]


def measure(pp: list[int], costs: list[str], reference: list[Row]) -> tuple[list[Row], list[Row]]:
    """pipec's rows and the peers' (torch live, plus the reference rows) over the grid."""
    ours: list[Row] = []
    peers: list[Row] = [r for r in reference if r.p in pp and r.costs in costs]
    for p, m in shapes(pp) + sorted({(r.p, r.m) for r in peers} - set(shapes(pp))):
        for c in costs:
            extra = {r.limit for r in peers if r.family == "v-adaptive" and (r.p, r.m) == (p, m)}
            ours += pipec_rows(p, m, c, {x for x in extra if x is not None})
            peers += torch_rows(p, m, c)
            peers += reproduced_rows(p, m, c)
    return ours, peers


def print_pair(pair: Pair) -> None:
    o, q = pair.ours, pair.peer
    limit = "-" if o.limit is None else f"{o.limit:g}"
    print(
        f"| {o.family} | {o.p} | {o.m} | {o.costs} | {limit} | {o.makespan:.10g} | {o.peak:g} "
        f"| {q.who} | {q.makespan:.10g} | {q.peak:g} | {pair.verdict} |"
    )


def summary(found: list[Pair]) -> None:
    """One line per (family, costs): pairs compared, how many equal, better, worse, and the
    largest gain over a peer."""
    print("| family | costs | pairs | equal | better | worse | largest gain |")
    print("|---|---|---|---|---|---|---|")
    keys = sorted(
        {(x.ours.family, x.ours.costs) for x in found},
        key=lambda k: (list(GROUP).index(k[0]), k[1]),
    )
    for family, costs in keys:
        mine = [x for x in found if (x.ours.family, x.ours.costs) == (family, costs)]
        count = {v: sum(x.verdict == v for x in mine) for v in ("equal", "better", "WORSE")}
        gain = max(0.0, *(1 - x.ours.makespan / x.peer.makespan for x in mine))
        print(
            f"| {family} | {costs} | {len(mine)} | {count['equal']} | {count['better']} "
            f"| {count['WORSE']} | {100 * gain:.2f}% |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", default=",".join(map(str, PP)), help="pipeline sizes, e.g. 4,8")
    ap.add_argument("--costs", default=",".join(COSTS), help="cost profiles: unit, 1.5B")
    ap.add_argument("--all", action="store_true", help="print every pair, not the summary")
    args = ap.parse_args()
    pp, costs = [int(x) for x in args.pp.split(",")], args.costs.split(",")
    ours, peers = measure(pp, costs, reference_rows())
    found = pairs(ours, peers)
    if args.all:
        print("| family | p | m | costs | limit | makespan | peak | peer | makespan | peak | |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for pair in found:
            print_pair(pair)
    else:
        summary(found)
    worse = [x for x in found if x.worse]
    print(f"\n{len(found)} pairs over p in {pp}, m in {{2p, 4p}}; pipec worse in {len(worse)}:")
    for pair in worse:
        print_pair(pair)
    sys.exit(1 if worse else 0)


if __name__ == "__main__":
    main()
