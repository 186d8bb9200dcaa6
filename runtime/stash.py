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


@dataclass(slots=True)
class Handle:
    """One saved tensor: the tensor itself, or (while evicted) where to find it in a buffer."""

    tensor: Tensor | None
    key: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # storage offset, in elements
    is_param: bool


class SavedTensors:
    """The tensors autograd saved in one forward; `pack`/`unpack` are the hooks."""

    def __init__(self, param_keys: frozenset[int]) -> None:
        self.param_keys = param_keys
        self.handles: list[Handle] = []
        self.nbytes = 0
        self._sizes: dict[int, int] = {}  # storage key -> bytes, non-parameter storages
        self._layout: dict[int, int] = {}  # while evicted: storage key -> byte offset in buffer

    def pack(self, t: Tensor) -> Handle:
        key = storage_key(t)
        is_param = key in self.param_keys
        if not is_param and key not in self._sizes:
            self._sizes[key] = t.untyped_storage().nbytes()
            self.nbytes += self._sizes[key]
        h = Handle(t, key, t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), is_param)
        self.handles.append(h)
        return h

    @staticmethod
    def unpack(h: Handle) -> Tensor:
        if h.tensor is None:
            raise RuntimeError("a stash was used while evicted (LOAD missing before its backward)")
        return h.tensor

    @property
    def evicted(self) -> bool:
        return bool(self._layout)

    def evict(self) -> Tensor:
        """One flat uint8 buffer holding every non-parameter storage; drops them here."""
        storages: dict[int, Tensor] = {}
        for h in self.handles:
            if not h.is_param and h.key not in storages:
                assert h.tensor is not None, "stash evicted twice"
                storages[h.key] = _bytes_of(h.tensor)
        offset = 0
        for key, b in storages.items():
            self._layout[key] = offset
            offset += -(-b.numel() // _ALIGN) * _ALIGN
        device = next(iter(storages.values())).device if storages else torch.device("cpu")
        buffer = torch.empty(offset, dtype=torch.uint8, device=device)
        for key, b in storages.items():
            buffer[self._layout[key] : self._layout[key] + b.numel()] = b
        for h in self.handles:
            if not h.is_param:
                h.tensor = None
        return buffer

    def restore(self, buffer: Tensor) -> None:
        """Rebuild the saved tensors from the buffer `evict` produced (sent back to us)."""
        storage = buffer.untyped_storage()
        for h in self.handles:
            if h.is_param:
                continue
            itemsize = torch.empty((), dtype=h.dtype).element_size()
            start = self._layout[h.key] // itemsize + h.offset
            h.tensor = torch.empty(0, dtype=h.dtype, device=buffer.device).set_(
                storage, start, h.size, h.stride
            )
        self._layout.clear()


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
