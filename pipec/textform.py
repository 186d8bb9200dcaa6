"""The text form of a rank program: what codegen prints, golden files hold and the runtime reads.

    # pipec program
    # version=1 rank=0 world=4 schedule=1f1b p=4 m=8 v=1 plan=3f2a9c0d1b7e4a55
    F s=0 mb=0
    SEND_ACT s=0 mb=0 to=1
    ...

One regular expression parses an instruction line; `parse_program(render(...)) == program`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipec.ir import FORMAT_VERSION, TO_PEER_OPS, Instr, Op, PipecError, Program

TITLE = "# pipec program"
_HEADER = re.compile(
    r"^# version=(?P<version>\d+) rank=(?P<rank>\d+) world=(?P<world>\d+) "
    r"schedule=(?P<schedule>[\w.:-]+) p=(?P<p>\d+) m=(?P<m>\d+) v=(?P<v>\d+) "
    r"plan=(?P<plan>[0-9a-f]{16})$"
)
_INSTR = re.compile(
    r"^(?P<op>[A-Z_]+)(?: s=(?P<stage>\d+))?(?: mb=(?P<mb>\d+))?"
    r"(?: (?P<dir>to|from)=(?P<peer>\d+))?$"
)


@dataclass(frozen=True)
class Header:
    """A program's identity: the runtime refuses a program whose header does not fit its run."""

    version: int
    rank: int
    world: int
    schedule: str
    p: int
    m: int
    v: int
    plan: str

    def __str__(self) -> str:
        return (
            f"# version={self.version} rank={self.rank} world={self.world} "
            f"schedule={self.schedule} p={self.p} m={self.m} v={self.v} plan={self.plan}"
        )


def parse_instr(line: str) -> Instr:
    """Parse one instruction line; ValueError says what is wrong with it."""
    m = _INSTR.match(line)
    if not m or m["op"] not in Op.__members__:
        raise ValueError(f"not an instruction: '{line}'")
    op = Op[m["op"]]
    if m["dir"] and (m["dir"] == "to") != (op in TO_PEER_OPS):
        raise ValueError(f"'{line}': {op.value} takes {'to' if op in TO_PEER_OPS else 'from'}=")
    field = {k: (int(m[k]) if m[k] is not None else None) for k in ("stage", "mb", "peer")}
    return Instr(op, **field)


def parse_program(text: str, source: str = "<program>") -> tuple[Header, Program]:
    """Parse a whole `.pipe` file; a PipecError names the file and line of any defect."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) < 2 or lines[0] != TITLE:
        raise PipecError(f"{source}: not a pipec program (missing '{TITLE}' header)")
    h = _HEADER.match(lines[1])
    if not h:
        raise PipecError(f"{source}:2: malformed header line '{lines[1]}'")
    fields = h.groupdict()
    header = Header(**{k: (v if k in ("schedule", "plan") else int(v)) for k, v in fields.items()})
    if header.version != FORMAT_VERSION:
        raise PipecError(
            f"{source}: format version {header.version}, this pipec reads {FORMAT_VERSION}; "
            "recompile with this pipec"
        )
    program = []
    for n, line in enumerate(lines[2:], start=3):
        try:
            program.append(parse_instr(line))
        except ValueError as e:
            raise PipecError(f"{source}:{n}: {e}") from None
    return header, tuple(program)
