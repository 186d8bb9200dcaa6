"""A stash: what autograd saved during one forward, held as tensors we can count, evict, reload.

The forward of (stage, mb) runs under `saved_tensors_hooks(saved.pack, saved.unpack)`, so every
tensor autograd keeps for the backward goes through a `Handle`. That gives the runtime:
- the stash's bytes (each storage once, parameters excluded: the frontend's measure), and
- BPipe's eviction: `evict()` copies the saved storages, back to back, into one flat byte
  buffer to send away and frees them here by shrinking each storage to zero bytes;
  `restore(buffer)` grows them back and copies the bytes in, before the backward unpacks them.

Shrinking the storage, rather than dropping our references to its tensors, is what makes the
memory go away for real: autograd's graph keeps the stage inputs alive (their AccumulateGrad
nodes hold the leaves), the stash keeps its outputs, views share storages, and none of that
matters to a storage of zero bytes. Every tensor keeps its identity, so the backward after the
restore is the one autograd recorded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor


def storage_key(t: Tensor) -> int:
    """Identity of a tensor's storage (views share it); valid while the storage lives."""
    return t.untyped_storage()._cdata


class SavedTensors:
    """The tensors autograd saved in one forward; `pack`/`unpack` are the hooks.

    `pack` runs for every saved tensor of every forward, so it only counts storages.
    """

    def __init__(self, param_keys: frozenset[int]) -> None:
        self.param_keys = param_keys
        self.tensors: list[Tensor] = []
        self.nbytes = 0
        self._sizes: dict[int, int] = {}  # storage key -> bytes, non-parameter storages
        self._storages: list[tuple[torch.UntypedStorage, int]] = []  # while evicted: (freed, bytes)
        self.evicted = False

    def pack(self, t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self._sizes and key not in self.param_keys:
            self._sizes[key] = n = storage.nbytes()
            self.nbytes += n
        # Detached: a saved output would otherwise hold its own grad_fn through what pack
        # returns, a reference cycle that keeps the whole graph (and the inputs' gradients)
        # alive until the garbage collector runs. Autograd restores the history when it unpacks.
        saved = t.detach()
        self.tensors.append(saved)
        return saved

    def unpack(self, saved: Tensor) -> Tensor:
        if self.evicted:
            raise RuntimeError("a stash was used while evicted (LOAD missing before its backward)")
        return saved

    def storages(self) -> dict[int, torch.UntypedStorage]:
        """Every non-parameter storage, each once, in first-saved order (the buffer's layout)."""
        out: dict[int, torch.UntypedStorage] = {}
        for t in self.tensors:
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in self.param_keys:
                out.setdefault(key, storage)
        return out

    def evict(self, size: int, keep: Iterable[int] = ()) -> Tensor:
        """The non-parameter storages packed back to back into a uint8 buffer of `size` bytes
        (the plan's stash bytes, known to the acceptor too); each is then freed here, except
        those in `keep` (storage keys something else on this rank still reads before LOAD)."""
        assert not self.evicted, "stash evicted twice"
        storages = self.storages()
        packed = sum(s.nbytes() for s in storages.values())
        if packed != size:
            raise RuntimeError(
                f"the stash holds {packed} bytes at run time, the plan measured {size}: the "
                "model changed since compiling; recompile"
            )
        device = next(iter(storages.values())).device if storages else torch.device("cpu")
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
        offset, kept = 0, frozenset(keep)
        for key, storage in storages.items():
            n = storage.nbytes()
            buffer[offset : offset + n] = _as_bytes(storage)
            offset += n
            if key not in kept:
                storage.resize_(0)
            self._storages.append((storage, n))
        self.evicted = True
        return buffer

    def restore(self, buffer: Tensor) -> None:
        """Refill every storage `evict` packed from the buffer it produced (sent back to us)."""
        offset = 0
        for storage, n in self._storages:
            if storage.nbytes() != n:
                storage.resize_(n)
            _as_bytes(storage).copy_(buffer[offset : offset + n])
            offset += n
        self._storages.clear()
        self.evicted = False


def _as_bytes(storage: torch.UntypedStorage) -> Tensor:
    """The whole storage as a 1-D uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def tensors_nbytes(tensors: list[Tensor] | tuple[Tensor, ...]) -> int:
    """Bytes of the distinct storages under `tensors`."""
    return sum({storage_key(t): t.untyped_storage().nbytes() for t in tensors}.values())


@dataclass(slots=True)
class Stash:
    """What (stage, mb) keeps from F to its backward.

    `nbytes` is what the stash counter counts for it: autograd's saved tensors (each storage
    once, parameters excluded), or the stage inputs alone when the forward is recomputed.
    """

    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...] | None
    saved: SavedTensors | None
    nbytes: int
    loading: bool = False  # LOAD posted, buffer not restored yet
