"""Checkpoints written in the background (runtime/saving.py's `Writer`), in one process: one
write at a time, each published whole or not at all, and a write that fails leaves the
previous checkpoint the newest intact one and raises in the caller's thread."""

from __future__ import annotations

import pytest
import torch

from pipec import checkpoint
from pipec.checkpoint_lineage import Lineage
from pipec.ir import PipecError
from pipec.runtime.saving import Writer

LINEAGE = Lineage("model", "build", "run", None)


def test_the_writes_come_in_turn_each_published_whole(tmp_path):
    writer = Writer(tmp_path, LINEAGE, None)
    for step in range(1, 4):
        writer.submit(step, {"model.w": torch.full((4,), float(step))})
    writer.wait()
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_000002", "step_000003"]
    for path in checkpoint.checkpoints(tmp_path):
        saved = checkpoint.verify(path)
        assert checkpoint.read(path, ["model.w"], saved)["model.w"].eq(saved["step"]).all()
    assert writer.completed() == [tmp_path / f"step_{k:06d}" for k in (1, 2, 3)]
    assert writer.completed() == []


def test_a_failed_write_leaves_the_previous_checkpoint_and_raises_in_the_caller(tmp_path):
    writer = Writer(tmp_path, LINEAGE, None)
    writer.submit(1, {"model.w": torch.ones(4)})
    writer.submit(2, {"model.w": torch.ones(4), "model.bad": object()})  # not a tensor
    with pytest.raises(PipecError, match=f"writing a checkpoint into {tmp_path} failed: "):
        writer.wait()
    assert checkpoint.newest_intact(tmp_path) == (tmp_path / "step_000001", [])
    writer.wait()  # said once
    writer.submit(3, {"model.w": torch.ones(4)})  # the next save cleans up the failed one's
    writer.wait()
    assert not list(tmp_path.glob(".*partial"))
