"""Python objects gathered from every rank, without numpy.

torch's `all_gather_object` turns the received bytes back into objects through
`tensor.numpy()`, so it fails where numpy is not installed, and pipec does not require numpy
(neither does torch). The same protocol in tensors only: each rank's pickled object as a byte
tensor, the lengths gathered first, then the bytes padded to the longest. The objects are the
ranks' own reports within one run (measurements, gradient checks), never data from a file.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist


def all_gather_objects(obj: Any, device: torch.device) -> list[Any]:
    """Every rank's `obj`, by rank, on every rank; `device` is where the backend's tensors live
    (CUDA for NCCL)."""
    data = pickle.dumps(obj)
    world = dist.get_world_size()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    mine = torch.zeros(max(lengths), dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    return [pickle.loads(bytes(t[:n].tolist())) for t, n in zip(everyone, lengths, strict=True)]
