"""Rank candidates no finer than the plan can predict: ties within the expected error.

Candidates are taken fastest first. With an expected error e (pipec/plan/calibration.py), two
candidates predicted within a factor (1 + e) of each other are tied; a tie group is a run of
candidates each within (1 + e) of the one before it, so any two rows whose difference is
within the error share a group. Inside a group the plan does not rank: it lists first the
rows within (1 + e) of the group's fastest, simplest first (plain 1F1B, then other plain
schedules, then memory-saving strategies, each by predicted time), then the rest of the group
by predicted time. Row 1, the pick, is thus the simplest row within the error of the fastest:
plain 1F1B whenever 1F1B is. Without an expected error (an uncalibrated plan) there are no
ties: every row is its own place.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipec.plan.candidates import BASELINE, Evaluated


def simplicity(ev: Evaluated) -> tuple[bool, bool, float, int]:
    """Order inside a tie: plain 1F1B first, then plain before memory-saving, then faster."""
    plain = ev.strategy == "plain"
    return (not (plain and ev.family == BASELINE), not plain, ev.iteration_s, ev.peak_bytes)


def groups(times: Sequence[float], error: float | None) -> list[int]:
    """For times in ascending order, each one's group: the index of the time that opened it
    (a time within (1 + error) of the one before it joins that one's group)."""
    out: list[int] = []
    for k, t in enumerate(times):
        joins = out and error is not None and t <= times[k - 1] * (1 + error)
        out.append(out[-1] if joins else k)
    return out


def ranked(fits: Sequence[Evaluated], error: float | None) -> tuple[list[Evaluated], list[int]]:
    """`fits` in the order the plan lists them and each row's place (1-based: the first row
    of its tie group)."""
    fastest = sorted(fits, key=lambda e: (e.iteration_s, e.peak_bytes))
    opened = groups([e.iteration_s for e in fastest], error)
    rows: list[Evaluated] = []
    places: list[int] = []
    for g in sorted(set(opened)):
        members = [e for e, o in zip(fastest, opened) if o == g]
        near = [e for e in members if e.iteration_s <= members[0].iteration_s * (1 + (error or 0))]
        members = sorted(near, key=simplicity) + members[len(near) :]
        places += [len(rows) + 1] * len(members)
        rows += members
    return rows, places
