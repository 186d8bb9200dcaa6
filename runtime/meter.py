"""The memory meter: the real bytes a rank holds, read after the instructions that can
allocate (the interpreter's `Positions.metered`; a send only lets buffers go), on CPU in most
steps only after those where the peak came in full steps (`Sampling`).

CUDA: the caching allocator's count, `torch.cuda.memory_allocated`: every live tensor on the
device, rounded up to the allocator's 512-byte blocks. The step's peak also takes
`max_memory_allocated`, reset at each step's start, which adds the peaks inside instructions
(an op's working memory, EVICT's buffer beside the stash it copies). As on CPU, the reading is
relative to the step's start: the model state plus what was allocated since. What the
allocator holds at the start beyond the model state is the libraries' and is left out
(`base`): cuBLAS keeps a workspace per stream it ran on through the allocator, 65 MiB on an
H100 under torch 2.11 (four ranks of the tiny GPT sharing one read 67-69 MiB against 2-4 MiB
predicted before this baseline).

CPU: the bytes glibc's malloc has handed out and not taken back, from `mallinfo2()`:
`uordblks` (chunks in use, in every thread's arena) plus `hblkhd` (blocks over the mmap
threshold, which malloc maps one by one: tensors from 128 KiB up). The reading is relative to
the step's start, where the rank holds only its parameters and the optimizer's state: it is
those bytes, exact from their storages, plus everything malloc handed out since the step
began and still holds. That covers every tensor storage (gradients, stashes, message and stash
buffers, the weight-gradient work B leaves for W) and what the process keeps beside them:
autograd's records of every live stash's graph (nodes, tensor headers, saved-variable entries;
30-50 KiB per stash of a two-layer GPT stage, see `graph_host_bytes`), the interpreter's own
records, gloo's small allocations. It sees nothing inside an instruction (its working memory).
Noise: glibc's per-thread caches keep up to 7 freed chunks under 1 KiB of each size and count
them in use (a few KiB to tens of KiB); Python objects under 512 bytes live in pymalloc's own
mapped arenas and are not counted; the first step also pays one-time allocations (kernels'
caches, threads), which later steps do not repeat.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from pipec.passes.memory_bytes import ACTIVATION_SHARE
from pipec.runtime.precision import grad_of
from pipec.runtime.stash import tensors_nbytes


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2():  # type: ignore[no-untyped-def]
    # PyDLL: called holding the GIL. The call takes microseconds and never enters Python, while
    # a release would let another thread (a send lane) take the GIL and make the interpreter
    # wait for it back after every reading.
    libc = ctypes.PyDLL(ctypes.util.find_library("c") or "libc.so.6")
    fn = getattr(libc, "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = _Mallinfo2
    return fn


_MALLINFO2 = _mallinfo2()


def heap_bytes() -> int:
    """Bytes malloc has handed out and not taken back (chunks in use plus mapped blocks)."""
    if _MALLINFO2 is None:
        raise RuntimeError("the CPU memory meter needs glibc 2.33+ (mallinfo2)")
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


class Meter:
    """Real bytes held by this rank: `start_step`, then `read()` after the instructions that
    can allocate."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.base = 0
        # what the allocator (CUDA) or malloc (CPU) holds now; bound once: read() is hot
        self._held: Callable[[], int] = (
            partial(torch.cuda.memory_allocated, device) if self.cuda else heap_bytes
        )
        self._state: tuple[tuple[int, int, int, int], int] | None = None  # see model_state

    def start_step(self, model_state: int) -> None:
        """A step begins, holding `model_state` bytes of parameters and optimizer state."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.base = self._held() - model_state

    def model_state(self, params: tuple[nn.Parameter, ...], optimizer: object) -> int:
        """`model_state_bytes`, counted again only when the number of gradients alive or of
        the optimizer's state entries changed: an optimizer makes its state at its first step
        and keeps its tensors' sizes, so every later step starts with the same bytes."""
        # runtime/optim.py's Trainer keeps its torch optimizer's state in `inner`
        states = getattr(getattr(optimizer, "inner", optimizer), "state", {})
        grads = [p for p in params if grad_of(p) is not None]
        key = (id(optimizer), len(states), sum(map(len, states.values())), len(grads))
        if self._state is None or self._state[0] != key:
            self._state = key, model_state_bytes(list(params), optimizer)
        return self._state[1]

    def read(self) -> int:
        return self._held() - self.base

    def step_peak(self, samples: Iterable[int]) -> int:
        """The step's peak: the samples' maximum, and on CUDA the allocator's (in-op) peak."""
        peak = max(samples, default=0)
        if self.cuda:
            peak = max(peak, torch.cuda.max_memory_allocated(self.device) - self.base)
        return peak


#: Steps between two full ones on CPU: every metered position is read in the first two steps,
#: in every FULL_EVERY-th and in the last; the steps between read only where the last full
#: step peaked (`Sampling`).
FULL_EVERY = 8


class Sampling:
    """After which instructions of one program the CPU meter reads, step by step.

    A CPU reading walks malloc's free lists: ~110 µs with the caches an instruction left cold
    (a tiny GPT rank holds ~650 free chunks), ten times the interpreter's own work for an
    instruction, and a 1F1B rank can read after 10 of its 33. A program repeats the same
    allocations every step, so its peak comes after the same instruction: a full step reads
    at every `metered` position, and the steps between read only after the instruction where
    the last full step peaked (its first highest reading). Such a step's peak is the same up
    to malloc's noise (a few KiB; the full steps' peaks are in the run's maximum anyway). On
    CUDA a reading is a counter: every step is full."""

    def __init__(self, metered: tuple[bool, ...], always_full: bool) -> None:
        self.metered, self.always_full = metered, always_full
        self.steps = 0
        self.sparse = metered

    def next_step(self, full: bool = False) -> tuple[bool, ...]:
        """Where this step reads; `full`: everywhere (the caller will show this step's bytes
        instruction by instruction)."""
        self.steps += 1
        if full or self.always_full or self.steps <= 2 or self.steps % FULL_EVERY == 0:
            return self.metered
        return self.sparse

    def learn(self, reads: tuple[bool, ...], real: list[int]) -> None:
        """After a step that read at `reads`, with `real` its readings carried forward."""
        if reads is not self.metered or not real:
            return
        peak = real.index(max(real))
        self.sparse = tuple(k == peak for k in range(len(real)))


def model_state_bytes(params: list[nn.Parameter], optimizer: object) -> int:
    """Parameters, their gradients and the optimizer's state tensors now alive, each storage
    once: the part of a reading that is not activations or messages."""
    tensors = list(params) + [g for p in params if (g := grad_of(p)) is not None]
    if hasattr(optimizer, "tensors"):  # runtime/optim.py's Trainer: masters and state
        tensors += optimizer.tensors()
    else:  # a torch optimizer, or a stand-in (tests) with no state
        states = getattr(optimizer, "state", {})
        tensors += [t for st in states.values() for t in st.values() if torch.is_tensor(t)]
    return tensors_nbytes(tensors)


@dataclass(frozen=True)
class StashExtras:
    """Per chunk, what one micro-batch holds beyond the frontend's stash bytes, measured on
    this machine: `host`, the bytes the CPU meter sees a stash hold beyond its tensors
    (autograd's records of the forward's graph); `w_held`, with the B/W split, the tensors B
    leaves for W (the Linear inputs and output gradients; empty without the split)."""

    host: tuple[int, ...]
    w_held: tuple[int, ...]


def module_extras(
    module: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    loss: Callable[[object], torch.Tensor] | None,
    stash_bytes: float,
    split: bool,
    held: int = 8,
) -> tuple[int, int]:
    """What one micro-batch of `module` (a stage, or a block of one) holds on `inputs` beyond
    its `stash_bytes`, run as the runtime runs it: each forward on inputs of its own (a
    received activation is a new tensor every micro-batch; shared ones would hide the input
    bytes a stash saves), its floating inputs as leaves, `loss` on the output of the last
    stage, the B/W split's Linear when `split` (the module is rewritten in place). `held`
    forwards first, kept alive, then `held` more, whose heap growth per forward, less the
    stash bytes and the output kept, is the host bytes (the first batch takes what glibc's
    thread cache held, freed chunks it counts as in use, which would otherwise hide part of
    the growth); then B of one of them, and what its W still needs (0 without the split).
    Returns (host, w_held)."""
    from pipec.runtime import bwsplit

    if split:
        bwsplit.split_backward(module)

    def forward() -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        leaves = tuple(x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs)
        y = module(*leaves)
        if loss is not None:
            y = loss(y)
        return leaves, (y,) if torch.is_tensor(y) else tuple(y)

    gc.collect()
    kept = [forward() for _ in range(held)]
    before = heap_bytes()
    kept += [forward() for _ in range(held)]
    per = (heap_bytes() - before) / held
    output = tensors_nbytes(list(kept[-1][1])) if loss is None else 0
    host = max(0, round(per - stash_bytes - output))
    w_held = 0
    if split:
        leaves, ys = kept.pop()
        outputs = [y for y in ys if y.requires_grad]
        grads = None if loss is not None else [torch.ones_like(y) for y in outputs]
        bwsplit.B(module, 0, outputs, grads, leaves)
        w_held = bwsplit.held_bytes(module, 0)
        bwsplit.W(module, 0)
    return host, w_held


def stash_extras(plan: dict, split: bool, spec: str | None = None) -> StashExtras:
    """`module_extras` of each of the plan's stages on the factory's example micro-batch at the
    plan's size (torch.export fixes it in the stages' graphs; `w_held` empty without `split`).
    `spec`: where the factory is (default: the plan's spec, as written)."""
    from pipec.frontend import build_stages, load_factory

    model = plan["model"]
    spec = spec or model["spec"]
    n = len(model["stages"])
    modules = build_stages(spec, model, list(range(n)))
    ms = load_factory(spec, model["seed"], model.get("micro_batch_size"))
    share = ACTIVATION_SHARE[plan.get("precision", "fp32")]  # back from the plan's pricing
    stash = [b / share for b in plan["costs"]["stash_bytes"]]
    inputs: tuple[torch.Tensor, ...] = tuple(ms.example_inputs)
    host, w_held = [], []
    for c, module in enumerate(modules):
        loss = (lambda y: ms.loss_fn(y, ms.example_target)) if c == n - 1 else None
        h, w = module_extras(module, inputs, loss, stash[c], split)
        host.append(h)
        w_held.append(w)
        with torch.no_grad():
            y = module(*inputs)
        inputs = (y,) if torch.is_tensor(y) else tuple(y)
    return StashExtras(tuple(host), tuple(w_held) if split else ())
