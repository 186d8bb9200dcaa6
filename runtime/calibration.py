"""What the runtime costs that no model fact says, measured on a machine: one row per figure,
with how it was measured, so that a torch upgrade knows what to measure again.

The compiler's passes take these figures as inputs (`ByteFacts.recv_host` of
passes/memory_bytes.py): they describe this runtime on this torch, not a schedule. This module
imports nothing heavy, so that `pipec plan` and `pipec show` read it without starting torch's
distributed package.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Calibration:
    """A measured figure of the runtime: its value, its unit and how it was measured."""

    value: float
    unit: str
    measured: str


#: Host bytes one posted gloo receive holds beside its buffer: part of the host term of a CPU
#: run's memory prediction (a gloo run posts a step's receives at its start).
GLOO_RECV_HOST = Calibration(
    1650.0,
    "bytes per posted receive",
    "torch 2.13, gloo on CPU: the host bytes of a rank before and after posting 64 receives of "
    "4 KiB, over 64: the tensor's header (~0.36 KiB) and gloo's request (~1.3 KiB)",
)
