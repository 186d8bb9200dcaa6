"""Synthetic model profiles for the planner's tests: MFU curves injected, nothing profiled.

Eight equal blocks; per sample each block does 1 MFLOP of F, B and W and stashes 1000 bytes
(its input, a message of floats: 1/16 of that); a block holds 1000 fp32 parameters. Times
follow from the MFU curve. Memory is predicted as for a GPU run (`device="cuda"`): receives
posted in place (NCCL), no host records.
"""

from collections.abc import Callable

from pipec.plan.facts import FBW, BlockFacts, MbsPoint, ModelProfile

N_BLOCKS = 8
PEAK = 1e9
STASH_PER_SAMPLE = 1000
INPUT_PER_SAMPLE = STASH_PER_SAMPLE // 16
PARAMS = 1000
FLOPS = FBW(1e6, 1e6, 1e6)


def synthetic_profile(
    mfu: Callable[[int], float], sizes=(1, 2, 4, 8, 16), device: str = "cuda"
) -> ModelProfile:
    """A profile whose device MFU at micro-batch size n is `mfu(n)`."""
    blocks = tuple(BlockFacts(PARAMS, 4 * PARAMS, FLOPS) for _ in range(N_BLOCKS))
    points = []
    for n in sizes:
        per_op = n / (PEAK * mfu(n))
        points.append(
            MbsPoint(
                mbs=n,
                seconds=tuple(
                    FBW(FLOPS.F * per_op, FLOPS.B * per_op, FLOPS.W * per_op) for _ in blocks
                ),
                stash_bytes=(STASH_PER_SAMPLE * n,) * N_BLOCKS,
                input_bytes=(INPUT_PER_SAMPLE * n,) * N_BLOCKS,
                message_bytes=(INPUT_PER_SAMPLE * n,) * N_BLOCKS,
            )
        )
    return ModelProfile("synthetic", blocks, tuple(points), 128, PEAK, "test", device=device)
