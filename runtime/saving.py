"""Checkpoints during a run, written off the step's critical path.

After a step that saves (`Saver`), each rank takes its part of the checkpoint
(runtime/named_state.py: a collective, so every rank does it in the step) and copies it to host
memory; a background thread (`Writer`) then writes it with `checkpoint.save` while training
goes on: every rank's safetensors file, then rank 0's manifest and the rename that publishes
the checkpoint, then the pruning of the run's older ones (pipec/checkpoint.py). The ranks'
writers meet in a gloo process group of their own, so they never interleave with the
training's collectives.

- At most one write is in flight: the next save, and the end of the run, first wait for it.
  A write that failed (a full disk, a peer gone) raises there, in the training thread; the
  previous checkpoint is then still the newest intact one, since nothing is published before
  its manifest is written.
- The last step's checkpoint, and a stopped run's (runtime/stopping.py), are complete before
  the run ends.
- A step's line says `saved DIR/step_N` once that checkpoint is complete: on the line of the
  step that saved it when the write was that quick, else on a later step's line (rank 0
  publishes each checkpoint and knows).

`python bench/checkpoint_step.py` measures a saving step against a plain one.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections import deque
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from pipec import checkpoint
from pipec.checkpoint_lineage import Lineage
from pipec.ir import PipecError
from pipec.runtime import named_state
from pipec.runtime.rank import Rank

#: The writer thread's nice value: the lowest priority.
WRITER_NICE = 19


class Writer:
    """Writes this rank's part of checkpoints into `directory` in a background thread, one at
    a time; `group`: the process group the ranks' writers meet in (None: one process)."""

    def __init__(
        self, directory: Path, lineage: Lineage | None, group: dist.ProcessGroup | None
    ) -> None:
        self.directory = Path(directory)
        self.lineage = lineage
        self.group = group
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done: deque[Path] = deque()  # on rank 0, which publishes them
        self._publishes = not dist.is_initialized() or dist.get_rank() == 0

    def submit(self, step: int, state: dict) -> None:
        """Start writing `state` (this rank's part, see checkpoint.state_dict) as step `step`,
        after the write in flight. Its tensors are the writer's from now on: a copy in host
        memory that training does not change (runtime/named_state.py's `state_dict`)."""
        self.wait()
        self._thread = threading.Thread(
            target=self._write, args=(step, state), name="pipec-checkpoint", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        """Wait for the write in flight; PipecError if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise PipecError(
                f"writing a checkpoint into {self.directory} failed: "
                f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
            ) from error

    def completed(self) -> list[Path]:
        """The checkpoints completed since the last call, oldest first (none but on rank 0,
        which publishes them)."""
        done = []
        while self._done:
            done.append(self._done.popleft())
        return done

    def _write(self, step: int, state: dict) -> None:
        # The lowest CPU priority (on Linux a thread's own): on a machine whose cores the
        # ranks keep busy, the write takes the time they leave idle, not theirs.
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        try:
            path = checkpoint.save(self.directory, step, state, self.lineage, self.group)
            if self._publishes:
                self._done.append(path)
        except BaseException as e:  # noqa: BLE001 - raised in the training thread by `wait`
            self._error = e


class Saver:
    """After step k: a checkpoint of the run in `directory` when k is a multiple of `every`
    (0: never) or the `last` step, or when `force`d (a stop); `lineage`: the run's, which its
    checkpoints record (pipec/checkpoint_lineage.py). `timeout`: how long a writer waits for
    the others.

    One copy of each stage is written: the first pipeline's stages (bidirectional schedules
    hold a replica of each in the second) of the first data-parallel copy."""

    def __init__(
        self,
        rt: Rank,
        directory: Path,
        every: int,
        last: int,
        lineage: Lineage | None = None,
        timeout: float = 60.0,
    ) -> None:
        first = set(rt.layout.pipelines[0].stages)
        self.rt = rt
        self.mine = [m for s, m in rt.modules.items() if s in first] if rt.dp_index == 0 else []
        self.every, self.last = every, last
        self.saved_step: int | None = None  # the last step submitted
        self.lower: frozenset[str] | None = None  # keys a lower rank writes (first save on)
        group = None
        if dist.is_initialized():  # every rank creates it, in the same order
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        self.writer = Writer(directory, lineage, group)

    def __call__(self, step: int, force: bool = False) -> None:
        if force or step == self.last or (self.every and step % self.every == 0):
            state = named_state.state_dict(self.rt.optimizer, self.mine)  # ZeRO copies gather
            if self.lower is None:  # once: a collective, whose answer does not change
                self.lower = named_state.held_lower(list(state), self.rt.device)
            self.writer.submit(step, {k: v for k, v in state.items() if k not in self.lower})
            self.saved_step = step
            if force or step == self.last:  # the run ends after it
                self.writer.wait()
