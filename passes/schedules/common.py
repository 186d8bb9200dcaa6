"""Building blocks shared by schedule families."""

from __future__ import annotations

from collections.abc import Sequence

from pipec.ir import Instr


def one_f_one_b(forwards: Sequence[Instr], backwards: Sequence[Instr], warmup: int) -> list[Instr]:
    """Warm up with `warmup` forwards, then alternate one forward and one backward, then drain.

    This is the 1F1B pattern of PipeDream-Flush/DAPPLE and Megatron's interleaved schedule;
    the families differ only in the sequences they feed it and the warm-up depth.
    """
    warmup = min(warmup, len(forwards))
    order = list(forwards[:warmup])
    for k, fwd in enumerate(forwards[warmup:]):
        order += [fwd, backwards[k]]
    order += backwards[len(forwards) - warmup :]
    return order
