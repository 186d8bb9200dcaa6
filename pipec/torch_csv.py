"""torch.distributed.pipelining's per-rank action CSV: the format, read and written without torch.

One row per pipeline rank (row r is rank r), one cell per action, in execution order; an empty
cell is an idle step. An action is `{stage}{type}{mb}` with a global stage index, e.g. `2F0`,
`5I3`, `1SEND_F4`, `0REDUCE_GRAD` (no micro-batch), or torch's overlapped pair
`(4F4;3B0)OVERLAP_F_B`. Types (torch 2.13's `_ComputationType`): F forward, B full backward,
I input backward, W weight backward, SEND_F/RECV_F/SEND_B/RECV_B point-to-point, UNSHARD/RESHARD
(FSDP), REDUCE_GRAD (per-stage gradient scaling/reduction after its last backward).
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass

from pipec.ir import PipecError

COMPUTE_TYPES = frozenset({"F", "B", "I", "W"})
TYPES = COMPUTE_TYPES | {
    "SEND_F",
    "RECV_F",
    "SEND_B",
    "RECV_B",
    "UNSHARD",
    "RESHARD",
    "REDUCE_GRAD",
}
OVERLAP = "OVERLAP_F_B"
# torch's `_action_regex`, anchored at both ends so that trailing junk is an error, not ignored.
_ACTION = re.compile(
    r"^(?P<stage>\d+)(?P<type>UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B|F|I|B|W)"
    r"(?P<mb>\d*)$"
)
_OVERLAP = re.compile(rf"^\((?P<subs>[^()]*)\){OVERLAP}$")


@dataclass(frozen=True, slots=True)
class Action:
    """One torch action; `mb` is None for per-stage actions (UNSHARD, RESHARD, REDUCE_GRAD)."""

    stage: int
    type: str
    mb: int | None = None

    def __str__(self) -> str:
        return f"{self.stage}{self.type}{'' if self.mb is None else self.mb}"


Cell = tuple[Action, ...]
"""One CSV cell: one action, or the actions of an OVERLAP_F_B in the order torch runs them."""


def format_cell(cell: Cell) -> str:
    if len(cell) == 1:
        return str(cell[0])
    return f"({';'.join(map(str, cell))}){OVERLAP}"


def _parse_action(text: str, where: str) -> Action:
    m = _ACTION.match(text.strip())
    if not m:
        raise PipecError(
            f"{where}: cannot read action '{text}'; expected [stage][type][mb] such as 2F0, "
            "5I3 or 1SEND_F4"
        )
    typ, mb = m["type"], m["mb"]
    if (mb == "") != (typ in ("UNSHARD", "RESHARD", "REDUCE_GRAD")):
        need = "takes no micro-batch" if mb else "needs a micro-batch index"
        raise PipecError(f"{where}: action '{text}': {typ} {need}")
    return Action(int(m["stage"]), typ, int(mb) if mb else None)


def parse_cell(text: str, where: str) -> Cell:
    """Parse one cell (empty: an idle step, returned as ())."""
    text = text.strip()
    if not text:
        return ()
    overlap = _OVERLAP.match(text)
    if overlap is None:
        return (_parse_action(text, where),)
    cell = tuple(_parse_action(s, where) for s in overlap["subs"].split(";") if s.strip())
    if not cell or any(a.type not in COMPUTE_TYPES for a in cell):
        raise PipecError(f"{where}: '{text}': OVERLAP_F_B must hold compute actions only")
    return cell


def read_csv(text: str, source: str) -> list[list[Cell]]:
    """Every rank's cells (idle steps dropped), row r being rank r."""
    rows = list(csv.reader(io.StringIO(text)))
    while rows and not any(c.strip() for c in rows[-1]):
        rows.pop()  # trailing blank lines
    if not rows:
        raise PipecError(f"{source}: empty; expected one row of actions per pipeline rank")
    out = []
    for r, row in enumerate(rows):
        cells = [parse_cell(c, f"{source}: rank {r}, column {k}") for k, c in enumerate(row)]
        out.append([c for c in cells if c])
    return out


def write_csv(rows: list[list[Cell]]) -> str:
    """The CSV text torch's `_load_csv` reads: one row per rank, `\\r\\n` as csv.writer writes."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    for row in rows:
        writer.writerow([format_cell(c) for c in row])
    return buf.getvalue()
