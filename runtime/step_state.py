"""What one rank's steps change, apart from what is fixed for the run (runtime/rank.py).

`StepState` is what a step under way holds: its stashes, the tensors waiting for a send or a
local stage, deferred weight gradients and accepted stashes, the reductions in flight, the
losses, the step's batches and the optimizer step's figures. `Rank.new_step` replaces it at
every step's start, so nothing of one step reaches the next; OPTIMIZER_STEP checks that the
program left nothing behind (runtime/grads.py).

`StashBytes` is the stash counter, which spans the run: the live stash bytes and their peak,
each stash's size as first measured, and a stash move's bytes per chunk when not the plan's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn

from pipec.runtime.data import MicroBatch
from pipec.runtime.optim import PendingStep, StepNumbers
from pipec.runtime.stash import Stash


@dataclass
class StepState:
    """Step `step` (1-based, 0 before the first) as it runs; keys are (stage, mb), or
    (kind, stage, mb) for a message's tensors."""

    step: int = 0
    stashes: dict[tuple[int, int], Stash] = field(default_factory=dict)
    local: dict[tuple[int, int, int], tuple[Tensor, ...]] = field(default_factory=dict)
    outbox: dict[tuple[int, int, int], tuple[Tensor, ...]] = field(default_factory=dict)
    held: dict[tuple[int, int], int] = field(default_factory=dict)  # W-pending and accepted bytes
    reductions: list[tuple[object, Tensor, list[nn.Parameter]]] = field(default_factory=list)
    synced: set[int] = field(default_factory=set)
    losses: dict[int, Tensor] = field(default_factory=dict)  # per micro-batch; Rank.loss_sums
    batches: dict[int, MicroBatch] = field(default_factory=dict)  # read by Rank.batch
    figures: StepNumbers | PendingStep | None = None  # the optimizer step's (None: none taken)

    def stepped(self, figures: StepNumbers | PendingStep | None) -> None:
        """The optimizer step's figures, as it returned them (a PendingStep while its gradient
        norm is summed over the ranks; None from a stand-in optimizer)."""
        self.figures = figures

    def numbers(self) -> StepNumbers | None:
        """The optimizer step's figures, waiting for a pending norm (which may raise
        NonFinite, on every rank alike)."""
        if isinstance(self.figures, PendingStep):
            self.figures = self.figures.result()
        return self.figures


@dataclass
class StashBytes:
    """The stash counter of a run: `live` bytes now, their `peak`, each (stage, mb)'s stash
    size measured at its first forward (`sizes`; later steps reuse it), and per chunk the bytes
    of a stash move when not the plan's (`moved`, runtime/offload.py's `size_moves`)."""

    live: int = 0
    peak: int = 0
    sizes: dict[tuple[int, int], int] = field(default_factory=dict)
    moved: tuple[int, ...] = ()

    def account(self, nbytes: int) -> None:
        """Add `nbytes` (negative: release) to the live stash bytes; keep the peak."""
        self.live += nbytes
        self.peak = max(self.peak, self.live)
