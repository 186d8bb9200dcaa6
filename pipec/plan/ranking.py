"""Rank candidates no finer than the plan can predict: ties within the expected error.

Candidates are taken fastest first. With an expected error e (pipec/plan/calibration.py),
the fastest opens a group, every later candidate predicted within (1 + e) times its time
joins it, and the first one beyond opens the next group. Inside a group the prediction
cannot tell the candidates apart, so they are listed simplest first: plain 1F1B, then other
plain schedules, then memory-saving strategies, each by predicted time. Row 1, the pick,
is thus plain 1F1B whenever 1F1B is within the error of the fastest. Without an expected
error (an uncalibrated plan) there are no ties: every row is its own place.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipec.plan.candidates import BASELINE, Evaluated


def simplicity(ev: Evaluated) -> tuple[bool, bool, float, int]:
    """Order inside a tie: plain 1F1B first, then plain before memory-saving, then faster."""
    plain = ev.strategy == "plain"
    return (not (plain and ev.family == BASELINE), not plain, ev.iteration_s, ev.peak_bytes)


def groups(times: Sequence[float], error: float | None) -> list[int]:
    """For times in ascending order, each one's group: the index of the time that opened it."""
    out: list[int] = []
    for k, t in enumerate(times):
        opened = out[-1] if out else 0
        out.append(opened if out and error is not None and t <= times[opened] * (1 + error) else k)
    return out


def ranked(fits: Sequence[Evaluated], error: float | None) -> tuple[list[Evaluated], list[int]]:
    """`fits` in the order the plan lists them and each row's place (1-based: the first row
    of its tie group)."""
    fastest = sorted(fits, key=lambda e: (e.iteration_s, e.peak_bytes))
    opened = groups([e.iteration_s for e in fastest], error)
    rows: list[Evaluated] = []
    places: list[int] = []
    for g in sorted(set(opened)):
        members = sorted((e for e, o in zip(fastest, opened) if o == g), key=simplicity)
        places += [len(rows) + 1] * len(members)
        rows += members
    return rows, places
