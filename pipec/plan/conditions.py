"""What a plan's times were measured under, and the one line that says when a run's differ.

An op's time depends on more than the op: the torch threads a rank computes with, how many
ranks share the machine's cores, the precision, the torch build and the device. A plan's
times hold for a run under the conditions they were measured under; `pipec plan` records
them (the calibration run's, else the block profile's: one process, timed alone), the build
keeps them beside the plan's prediction, and a run under other conditions is told so before
its first step (runtime/main.py) and by `pipec show`. The load average is recorded to read
the figures by; it is not compared (a run's own ranks load the machine).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

#: The conditions a run's times depend on, as `differences` names them.
COMPARED = ("threads", "ranks", "precision", "torch", "device")


@dataclass(frozen=True)
class Conditions:
    """Threads per rank, ranks computing at once on the machine, precision, torch version,
    device type, the machine's cores and its 1-minute load average when measured."""

    threads: int
    ranks: int
    precision: str
    torch: str
    device: str
    cores: int
    load: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> Conditions:
        return Conditions(**{k: d[k] for k in Conditions.__dataclass_fields__})

    def text(self) -> str:
        ranks = "1 rank, timed alone" if self.ranks == 1 else f"{self.ranks} ranks at once"
        return (
            f"{self.threads} thread(s) per rank, {ranks}, {self.precision}, torch "
            f"{self.torch}, {self.device} ({self.cores} cores, load {self.load:.1f})"
        )

    def differences(self, run: Conditions) -> list[str]:
        """What `run` does differently, in words (empty: the same conditions)."""
        names = {"threads": "threads per rank", "ranks": "ranks", "torch": "torch"}
        return [
            f"{names.get(k, k)} {getattr(self, k)} -> {getattr(run, k)}"
            for k in COMPARED
            if getattr(self, k) != getattr(run, k)
        ]


def current(threads: int, ranks: int, precision: str, device: str) -> Conditions:
    """This machine's conditions for a run of `ranks` ranks with `threads` threads each."""
    import torch

    return Conditions(
        threads=threads,
        ranks=ranks,
        precision=precision,
        torch=torch.__version__,
        device=device,
        cores=os.cpu_count() or 1,
        load=os.getloadavg()[0],
    )


def notice(planned: dict[str, Any] | None, run: Conditions) -> str | None:
    """The line that says a run's conditions differ from those of the plan's times (None:
    they do not, or the build did not come from a plan that recorded them)."""
    if not planned or not planned.get("conditions"):
        return None
    measured = Conditions.from_json(planned["conditions"])
    changed = measured.differences(run)
    if not changed:
        return None
    return (
        f"the plan's times were measured with {measured.text()}; this run differs "
        f"({', '.join(changed)}), so its predicted iteration time does not apply to it"
    )
