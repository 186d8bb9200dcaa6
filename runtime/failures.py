"""A failed attempt of a run, as torchrun's agent records it and `pipec run` says it.

When a rank fails, torchrun stops the others and, with `--max-restarts N`, starts the group
again, up to N times. pipec's agent (runtime/agent.py) turns what torchelastic knows of the
failed attempt into one `Failure`: each rank's exit code or the signal that killed it, the rank
it found stopped (SIGSTOP, a debugger: hung, so it killed it), and what each rank left in its
error file (runtime/faults.py: pipec's line and the step it was at). Started by `pipec run`
(`RECORDS` set), the agent writes each record as one JSON line on stderr after `RECORD`;
`pipec run` prints it as one line of its own (`Failure.line`):

    rank 1 killed (SIGKILL) at step 7; restart 1 of 3 from step 6

and, once no restart is left, exits with the failure's code (`Failure.code`).

This module must not import torch: `pipec run` reads the records.
"""

from __future__ import annotations

import json
import signal
from dataclasses import asdict, dataclass

from pipec.runtime.faults import EXIT_FAULT

#: Set (to anything) in the agent's environment: write each failure's record on stderr.
RECORDS = "PIPEC_FAILURE_RECORDS"
#: What a record's line starts with, before its JSON.
RECORD = "pipec-agent-failure: "


@dataclass(frozen=True)
class RankEnd:
    """How one rank of a failed attempt ended: its `exitcode` as torchelastic gives it (the
    signal's number, negated, for a process killed by a signal; None: ended well, or by
    torchrun's stop after a peer's failure was recorded), whether the agent found it `stopped`
    and killed it, whether it had `ended` by itself before torchrun stopped the group, and what
    it said in its error file (`message`, and the `step` it was at)."""

    rank: int
    exitcode: int | None = None
    stopped: bool = False
    ended: bool = False
    message: str = ""
    step: int | None = None

    def signal_name(self) -> str:
        """The name of the signal that killed the rank ('' if none did)."""
        if self.exitcode is None or self.exitcode >= 0:
            return ""
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def how(self) -> str:
        """What became of the rank, in a few words."""
        if self.stopped:
            return f"rank {self.rank} hung (its process stopped, killed)"
        if self.signal_name():
            return f"rank {self.rank} killed ({self.signal_name()})"
        return f"rank {self.rank} exited with code {self.exitcode}"

    def said(self) -> str:
        """The rank's own line, without its rank ('' if it left none)."""
        return self.message.removeprefix(f"rank {self.rank}: ")


@dataclass(frozen=True)
class Failure:
    """A failed attempt: how its ranks ended, and what torchrun does next: restart number
    `restart` of `max_restarts`, or none (None) when they are spent."""

    ranks: tuple[RankEnd, ...]
    restart: int | None
    max_restarts: int

    def cause(self) -> RankEnd:
        """The rank whose end the others followed: one found stopped (its peers then timed
        out), else of those that ended by themselves (torchrun stopped the others) one killed
        by a signal (its peers then lost it), else the first with an exit code, else the
        lowest."""
        ranks = sorted(self.ranks, key=lambda r: r.rank)
        first = [r for r in ranks if r.ended] or ranks
        for found in (
            [r for r in ranks if r.stopped],
            [r for r in first if r.signal_name()],
            [r for r in first if r.exitcode],
        ):
            if found:
                return found[0]
        return ranks[0]

    def step(self) -> int | None:
        """The step the attempt failed at: the cause's, else the latest any rank said."""
        steps = [r.step for r in self.ranks if r.step is not None]
        return self.cause().step if self.cause().step is not None else max(steps, default=None)

    def code(self) -> int:
        """The exit code of the run it ends: the cause's own, 128 + the signal that killed it,
        or a fault's (`EXIT_FAULT`) for a rank that hung."""
        cause = self.cause()
        if cause.stopped or cause.exitcode is None:
            return EXIT_FAULT
        return cause.exitcode if cause.exitcode > 0 else 128 - cause.exitcode

    def line(self, resumed: int | None) -> str:
        """One line: what failed and where, and what follows (`resumed`: the step a restart
        resumes from, None from the start)."""
        step = self.step()
        at = f" at step {step}" if step is not None else ""  # no rank said where it was
        if self.restart is None:
            then = f"no restart left ({self.max_restarts} used)"
        else:
            start = f"step {resumed}" if resumed is not None else "the start"
            then = f"restart {self.restart} of {self.max_restarts} from {start}"
        cause = self.cause()
        said = f": {cause.said()}" if cause.said() else ""
        return f"{cause.how()}{at}{said}; {then}"

    def to_line(self) -> str:
        """The record as the agent writes it: `RECORD` and JSON, one line."""
        return RECORD + json.dumps(asdict(self)) + "\n"

    @staticmethod
    def parse(line: str) -> Failure | None:
        """The record a line holds, or None when it is not one."""
        if not line.startswith(RECORD):
            return None
        data = json.loads(line[len(RECORD) :])
        ranks = tuple(RankEnd(**r) for r in data.pop("ranks"))
        return Failure(ranks, **data)
