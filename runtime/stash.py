"""A stash: what autograd saved during one forward, held by handles we can count, evict, reload.

The forward of (stage, mb) runs under `saved_tensors_hooks(saved.pack, saved.unpack)`, so every
tensor autograd keeps for the backward goes through a `Handle`. That gives the runtime:
- the stash's bytes (each storage once, parameters excluded: the frontend's measure), and
- BPipe's eviction: `evict()` packs the saved storages into one flat byte buffer to send away
  and drops them here; `restore(buffer)` rebuilds every saved tensor (views included) from the
  buffer that came back, before the backward unpacks them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_ALIGN = 16  # bytes; every storage starts aligned in the flat buffer, so any dtype can view it


def storage_key(t: Tensor) -> int:
    """Identity of a tensor's storage (views share it); valid while the storage lives."""
    return t.untyped_storage()._cdata


class Handle:
    """One saved tensor; while its stash is evicted, where to rebuild it from in the buffer."""

    __slots__ = ("tensor", "view")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor: Tensor | None = tensor
        # (storage key, dtype, size, stride, storage offset), taken when evicted
        self.view: tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...], int] | None = None


class SavedTensors:
    """The tensors autograd saved in one forward; `pack`/`unpack` are the hooks.

    `pack` runs for every saved tensor of every forward, so it only counts storages; the
    layout of each view is taken when (and if) the stash is evicted.
    """

    def __init__(self, param_keys: frozenset[int]) -> None:
        self.param_keys = param_keys
        self.handles: list[Handle] = []
        self.nbytes = 0
        self._sizes: dict[int, int] = {}  # storage key -> bytes, non-parameter storages
        self._offsets: dict[int, int] = {}  # while evicted: storage key -> byte offset in buffer

    def pack(self, t: Tensor) -> Handle:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self._sizes and key not in self.param_keys:
            self._sizes[key] = n = storage.nbytes()
            self.nbytes += n
        h = Handle(t)
        self.handles.append(h)
        return h

    @staticmethod
    def unpack(h: Handle) -> Tensor:
        if h.tensor is None:
            raise RuntimeError("a stash was used while evicted (LOAD missing before its backward)")
        return h.tensor

    def evict(self) -> Tensor:
        """One flat uint8 buffer holding every non-parameter storage; drops them here."""
        storages: dict[int, Tensor] = {}
        moved = []
        for h in self.handles:
            t = h.tensor
            assert t is not None, "stash evicted twice"
            key = storage_key(t)
            if key in self.param_keys:
                continue
            storages.setdefault(key, _bytes_of(t))
            h.view = (key, t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
            moved.append(h)
        offset = 0
        for key, b in storages.items():
            self._offsets[key] = offset
            offset += -(-b.numel() // _ALIGN) * _ALIGN
        device = next(iter(storages.values())).device if storages else torch.device("cpu")
        buffer = torch.empty(offset, dtype=torch.uint8, device=device)
        for key, b in storages.items():
            buffer[self._offsets[key] : self._offsets[key] + b.numel()] = b
        for h in moved:
            h.tensor = None
        return buffer

    def restore(self, buffer: Tensor) -> None:
        """Rebuild the saved tensors from the buffer `evict` produced (sent back to us)."""
        storage = buffer.untyped_storage()
        for h in self.handles:
            if h.view is None:
                continue  # a parameter: never left
            key, dtype, size, stride, offset = h.view
            start = self._offsets[key] // torch.empty((), dtype=dtype).element_size() + offset
            h.tensor = torch.empty(0, dtype=dtype, device=buffer.device).set_(
                storage, start, size, stride
            )
            h.view = None
        self._offsets.clear()


def _bytes_of(t: Tensor) -> Tensor:
    """The whole storage under `t` as a 1-D uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def tensors_nbytes(tensors: list[Tensor] | tuple[Tensor, ...]) -> int:
    """Bytes of the distinct storages under `tensors`."""
    return sum({storage_key(t): t.untyped_storage().nbytes() for t in tensors}.values())


@dataclass(slots=True)
class Stash:
    """What (stage, mb) keeps from F to its backward.

    `nbytes` is what the memory meter counts for it: autograd's saved tensors (each storage
    once, parameters excluded), or the stage inputs alone when the forward is recomputed.
    """

    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...] | None
    saved: SavedTensors | None
    nbytes: int
    evicted_size: int = 0  # bytes of the flat buffer while evicted
    loading: bool = False  # LOAD posted, buffer not restored yet
