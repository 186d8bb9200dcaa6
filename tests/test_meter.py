"""The memory meter's CUDA reading, against a stand-in allocator (no GPU here): relative to the
step's start like the CPU one, so what the libraries keep on the device (cuBLAS's workspaces,
65 MiB read on an H100) stays out of a rank's real peak."""

from __future__ import annotations

import pytest
import torch

from pipec.runtime.meter import Meter

MIB = 1 << 20


class Allocator:
    """What torch.cuda's allocator counters report: bytes allocated and the peak since reset."""

    def __init__(self, held: int) -> None:
        self.held = self.peak = held

    def allocate(self, n: int) -> None:
        self.held += n
        self.peak = max(self.peak, self.held)

    def reset_peak(self, device: object = None) -> None:
        self.peak = self.held


@pytest.fixture
def allocator(monkeypatch: pytest.MonkeyPatch) -> Allocator:
    alloc = Allocator(0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: alloc.held)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: alloc.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", alloc.reset_peak)
    return alloc


def test_cuda_reading_leaves_out_what_the_device_held_beyond_the_model(allocator: Allocator):
    model, workspace = 3 * MIB, 64 * MIB
    allocator.allocate(model + workspace)  # step 1 left cuBLAS's workspace behind
    meter = Meter(torch.device("cuda", 0))
    meter.start_step(model)
    assert meter.read() == model
    allocator.allocate(2 * MIB)  # a stash
    first = meter.read()
    allocator.allocate(MIB)  # an op's working memory, freed inside the instruction
    allocator.allocate(-MIB)
    assert first == model + 2 * MIB
    assert meter.step_peak([model, first]) == model + 3 * MIB  # the allocator's in-op peak


def test_each_step_takes_its_own_baseline(allocator: Allocator):
    """A library that allocates more between steps (a new stream's workspace) moves the
    baseline, not the next step's peak; the step that allocated it read it."""
    model = 3 * MIB
    allocator.allocate(model)
    meter = Meter(torch.device("cuda", 0))
    meter.start_step(model)
    allocator.allocate(32 * MIB)  # the first matmul's workspace, inside step 1
    assert meter.step_peak([meter.read()]) == model + 32 * MIB
    meter.start_step(model)
    allocator.allocate(MIB)
    assert meter.step_peak([meter.read()]) == model + MIB
