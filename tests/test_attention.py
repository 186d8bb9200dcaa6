"""The attention kernel vs SDPA: outputs, gradients, head dims, GQA, the example models (eager
and exported), the SDPA fallback, the op's FLOPs and shapes, and bad inputs.

Without CUDA the kernels run under the Triton interpreter on CPU tensors; with CUDA they are
compiled and the same tests run on the GPU, plus the bf16 test marked `gpu`.

Relative error: rel(a, b) = max|a - b| / max|b|, b being the reference: SDPA run in float64 on
the same inputs (upcast exactly), so the number measures the kernel's error alone. Bounds: fp32
1e-5, fp16 2e-3, bf16 3e-2 (bf16 has 8 mantissa bits; the errors measured are about 1e-2).
"""

import os
import re
import sys
import warnings

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # Triton decides to interpret a kernel when it is decorated, i.e. when runtime.kernels is
    # first imported: this must come before that import.
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pipec.frontend import ModelSpec, load_factory, split_model
from pipec.frontend.blocks import find_blocks
from pipec.runtime.kernels import attention

flash = sys.modules["pipec.runtime.kernels.flash"]
dispatch = sys.modules["pipec.runtime.kernels.attention"]
if DEVICE == "cpu" and not flash.INTERPRET:
    pytest.skip(
        "pipec.runtime.kernels was imported (by an earlier test module) before this module set "
        "TRITON_INTERPRET=1, so its kernels cannot run on CPU; run this file on its own or with "
        "TRITON_INTERPRET=1 in the environment",
        allow_module_level=True,
    )

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force the kernel even on CPU tensors (the default there is SDPA)."""
    monkeypatch.setenv("PIPEC_ATTENTION", "triton")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|, in float64."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max()).item()


def reference(q, k, v, is_causal: bool) -> torch.Tensor:
    """SDPA with k/v heads repeated for GQA: independent of the dispatcher under test."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def out_and_grads(fn, q, k, v, do, is_causal: bool) -> tuple[torch.Tensor, ...]:
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, is_causal=is_causal)
    return (out, *torch.autograd.grad(out, leaves, do))


def check_against_sdpa(dtype, is_causal, seq, head_dim, heads=2, kv_heads=2, batch=1) -> None:
    """Kernel output, dQ, dK, dV within TOL[dtype] of float64 SDPA (relative error above)."""
    torch.manual_seed(seq * head_dim + heads)
    q = torch.randn(batch, heads, seq, head_dim, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, seq, head_dim, device=DEVICE, dtype=dtype) for _ in "kv")
    do = torch.randn_like(q)
    got = out_and_grads(attention, q, k, v, do, is_causal)
    want = out_and_grads(reference, *(t.double() for t in (q, k, v, do)), is_causal)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == dtype and a.shape == b.shape, name
        err = rel(a, b)
        assert err <= TOL[dtype], f"{name}: relative error {err:.2e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("seq", [64, 50], ids=["seq64", "ragged50"])
def test_matches_sdpa(dtype, is_causal, head_dim, seq):
    check_against_sdpa(dtype, is_causal, seq, head_dim)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_matches_sdpa_several_tiles(is_causal):
    """seq 150 spans three 64-wide tiles: the online rescaling, the unmasked stage of the causal
    loops and a ragged last tile all run."""
    check_against_sdpa(torch.float32, is_causal, seq=150, head_dim=32)


@pytest.mark.parametrize(
    ("head_dim", "dtype", "is_causal", "seq"),
    [
        (16, torch.float32, True, 50),
        (24, torch.float16, False, 64),
        (48, torch.float32, False, 50),
        (80, torch.bfloat16, True, 64),
        (96, torch.float16, True, 50),
        (128, torch.float16, True, 50),
        (192, torch.float32, True, 64),
        (256, torch.float16, False, 50),
        (256, torch.bfloat16, True, 64),
    ],
)
def test_head_dims_16_to_256(head_dim, dtype, is_causal, seq):
    """Powers of two run unpadded; the others (24, 48, 80, 96, 192) are padded to the next power
    of two inside the kernel, the extra columns masked on load and never stored."""
    check_against_sdpa(dtype, is_causal, seq, head_dim)


@pytest.mark.parametrize(
    ("dtype", "is_causal", "seq", "heads", "kv_heads", "head_dim"),
    [
        (torch.float32, True, 50, 4, 2, 32),
        (torch.float32, False, 150, 3, 1, 32),
        (torch.float16, True, 64, 4, 1, 32),
        (torch.bfloat16, True, 50, 4, 2, 16),
        (torch.float32, False, 64, 4, 2, 48),
    ],
)
def test_gqa_matches_sdpa(dtype, is_causal, seq, heads, kv_heads, head_dim):
    """dK/dV of a kv head are the sums over its group of q heads."""
    check_against_sdpa(dtype, is_causal, seq, head_dim, heads=heads, kv_heads=kv_heads, batch=2)


def test_bf16_interpreted_dots_are_fp32():
    """The interpreter's bf16 tl.dot is wrong; the kernel must upcast before it."""
    check_against_sdpa(torch.bfloat16, True, seq=50, head_dim=32)


# Opt-in shared memory per block: H100 (227 KiB) and A100 (163 KiB).
SHARED_BYTES = {"H100": 232448, "A100": 166912}


@pytest.mark.parametrize("gpu", SHARED_BYTES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
def test_every_head_dim_has_a_candidate_the_gpu_can_hold(kernel, dtype, gpu, monkeypatch):
    """The GPU path never meets a shape without a legal tile: for every head dim class and
    dtype some candidate fits the device's shared memory (as estimated), the untimed choice
    (PIPEC_ATTENTION_AUTOTUNE=0) among them, and every candidate passes the kernel's static
    asserts (tiles of at least 16; the causal band's tile divisibility)."""
    for block_d in (16, 32, 64, 128, 256):
        monkeypatch.delenv("PIPEC_ATTENTION_AUTOTUNE", raising=False)
        tiles = flash.candidates(kernel, block_d, dtype.itemsize, SHARED_BYTES[gpu])
        need = [flash._shared_bytes(kernel, t, block_d, dtype.itemsize) for t in tiles]
        assert tiles and max(need) <= SHARED_BYTES[gpu], (block_d, tiles)
        monkeypatch.setenv("PIPEC_ATTENTION_AUTOTUNE", "0")
        assert flash.candidates(kernel, block_d, dtype.itemsize, SHARED_BYTES[gpu]) == tiles[:1]
        for m, n, _, _ in tiles:
            owned, streamed = (n, m) if kernel == "dkdv" else (m, n)
            assert min(m, n) >= 16 and owned % streamed == 0, (m, n)


def test_sdpa_backend_handles_gqa(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PIPEC_ATTENTION", "sdpa")
    q, k, v = torch.randn(1, 4, 8, 32), torch.randn(1, 2, 8, 32), torch.randn(1, 2, 8, 32)
    torch.testing.assert_close(attention(q, k, v, is_causal=True), reference(q, k, v, True))


def test_default_backend_is_sdpa_on_cpu(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("PIPEC_ATTENTION")
    assert dispatch._backend(torch.empty(0)) == "sdpa"


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention through `attention`, then an MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # view + transpose: non-contiguous q, k, v and a non-contiguous upstream gradient.
        q, k, v = (
            t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(C, 2)
        )
        x = x + self.proj(attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class ToyGPT(nn.Module):
    """Token and position embeddings, two blocks, a final norm and an untied LM head."""

    def __init__(self, vocab: int = 64, width: int = 64, heads: int = 2, seq: int = 64) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.Sequential(Block(width, heads), Block(width, heads))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        logits = self.head(self.ln_f(self.blocks(x)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_toy_gpt_matches_sdpa(monkeypatch: pytest.MonkeyPatch):
    """Loss and every parameter gradient of a 2-layer GPT agree between the two backends."""
    torch.manual_seed(0)
    model = ToyGPT().to(DEVICE)
    idx, targets = torch.randint(0, 64, (2, 2, 40), device=DEVICE)
    results = {}
    for backend in ("triton", "sdpa"):
        monkeypatch.setenv("PIPEC_ATTENTION", backend)
        model.zero_grad()
        loss = model(idx, targets)
        loss.backward()
        results[backend] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (loss, grads), (ref_loss, ref_grads) = results["triton"], results["sdpa"]
    assert rel(loss, ref_loss) <= TOL[torch.float32]
    for name, grad in grads.items():
        err = rel(grad, ref_grads[name])
        assert err <= TOL[torch.float32], f"{name}: relative error {err:.2e}"


EXAMPLES = (
    "examples/gpt.py:tiny",
    "examples/gpt.py:deep",
    "examples/gpt.py:small",
    "examples/gpt.py:tiny_tied",
    "examples/llama.py:tiny",
)


def run_example(spec: str, backend: str, monkeypatch, backward: bool = False):
    """(output, parameter gradients or None, kernel launches, blocks) of one forward of
    `spec`'s model on `backend`; a KernelFallback warning fails the test."""
    calls = []
    forward = flash.forward
    monkeypatch.setattr(flash, "forward", lambda *a: calls.append(1) or forward(*a))
    monkeypatch.setenv("PIPEC_ATTENTION", backend)
    ms = load_factory(spec)
    model = ms.model.to(DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.KernelFallback)
        out = model(*(x.to(DEVICE) for x in ms.example_inputs))
    grads = None
    if backward:
        ms.loss_fn(out, ms.example_target.to(DEVICE)).backward()
        grads = [p.grad for p in model.parameters()]
    return out.detach(), grads, len(calls), find_blocks(model).n_blocks


@pytest.mark.parametrize("spec", EXAMPLES)
def test_example_models_run_on_the_kernel(spec, monkeypatch: pytest.MonkeyPatch):
    """Every runnable example (head dims 16 and 32) runs its forward on the kernel, one launch
    per block and never the fallback, and matches its SDPA forward."""
    out, _, launches, blocks = run_example(spec, "triton", monkeypatch)
    ref, _, _, _ = run_example(spec, "sdpa", monkeypatch)
    assert launches == blocks
    assert rel(out, ref) <= TOL[torch.float32]


def test_example_gradients_on_the_kernel(monkeypatch: pytest.MonkeyPatch):
    """Tiny LLaMA (head dim 16, 4 q heads on 2 kv heads): the loss's parameter gradients through
    the kernel's backward equal those through SDPA."""
    _, grads, _, _ = run_example("examples/llama.py:tiny", "triton", monkeypatch, backward=True)
    _, ref, _, _ = run_example("examples/llama.py:tiny", "sdpa", monkeypatch, backward=True)
    assert max(rel(a, b) for a, b in zip(grads, ref)) <= TOL[torch.float32]


def test_exported_stages_run_the_kernel_forward_and_backward(monkeypatch: pytest.MonkeyPatch):
    """torch.export keeps the op as one node: the exported stages of tiny LLaMA (head dim 16,
    GQA) launch the kernel's forward and backward once per block each, and their gradients
    equal the eager model's through SDPA."""
    launches = {"forward": 0, "backward": 0}
    for name, launch in [(name, getattr(flash, name)) for name in launches]:

        def counted(*args, name=name, launch=launch):  # type: ignore[no-untyped-def]
            launches[name] += 1
            return launch(*args)

        monkeypatch.setattr(flash, name, counted)
    ms = load_factory("examples/llama.py:tiny")
    model = ms.model.to(DEVICE)
    x, target = tuple(t.to(DEVICE) for t in ms.example_inputs), ms.example_target.to(DEVICE)
    stages = split_model(ModelSpec(model, x, target, ms.loss_fn), 2, "uniform")
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.KernelFallback)
        ms.loss_fn(stages[1](stages[0](*x)), target).backward()
    blocks = find_blocks(model).n_blocks
    assert launches == {"forward": blocks, "backward": blocks}
    grads = {n: p.grad.clone() for stage in stages for n, p in stage.named_parameters()}
    monkeypatch.setenv("PIPEC_ATTENTION", "sdpa")
    model.zero_grad()
    ms.loss_fn(model(*x), target).backward()
    for name, p in model.named_parameters():
        assert rel(grads[name], p.grad) <= TOL[torch.float32], name


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_flop_counter_counts_the_op(backend, monkeypatch: pytest.MonkeyPatch):
    """FlopCounterMode counts the op and its backward op by torch's SDPA formulas, whichever
    backend runs: forward 2 products of b·h·s²·d (4 FLOPs each), backward 5 (scores
    recomputed), with GQA's k/v heads counted as broadcast to every q head."""
    monkeypatch.setenv("PIPEC_ATTENTION", backend)
    b, h, s, d = 2, 4, 32, 16
    q = torch.randn(b, h, s, d, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(b, 2, s, d, device=DEVICE, requires_grad=True) for _ in "kv")
    with FlopCounterMode(display=False) as counter:
        out = attention(q, k, v, is_causal=True)
        forward = counter.get_total_flops()
        out.backward(torch.ones_like(out))
    assert forward == 2 * (2 * b * h * s * s * d)
    assert counter.get_total_flops() - forward == 5 * (2 * b * h * s * s * d)
    assert k.grad.shape == k.shape


def test_meta_tensors_take_the_ops_shapes():
    """Meta (and fake) tensors run the op's registered shapes, forward and backward: a
    paper-sized model is costed without memory."""
    q = torch.empty(1, 8, 4096, 128, device="meta", requires_grad=True)
    k, v = (torch.empty(1, 2, 4096, 128, device="meta", requires_grad=True) for _ in "kv")
    out = attention(q, k, v, is_causal=True)
    out.backward(torch.ones_like(out))
    assert out.shape == q.shape and (q.grad.shape, k.grad.shape) == (q.shape, k.shape)


@pytest.mark.parametrize(
    ("dtype", "q_shape", "kv_shape", "v_dim", "is_causal"),
    [
        (torch.float32, (2, 4, 20, 32), (2, 2, 20, 32), 32, True),
        (torch.float16, (1, 2, 16, 32), (1, 2, 16, 32), 32, True),
        (torch.float64, (1, 2, 16, 320), (1, 1, 24, 320), 64, True),
        (torch.bfloat16, (1, 4, 16, 32), (1, 2, 16, 32), 32, False),
    ],
    ids=["fp32-gqa", "fp16", "fp64-hd320-seq-v64", "bf16-gqa"],
)
def test_sdpa_backend_gradients_match_sdpa(dtype, q_shape, kv_shape, v_dim, is_causal, monkeypatch):
    """The op's SDPA backward (written out, scores recomputed, in fp32 or wider) gives SDPA's
    gradients, also where the kernel cannot run (head dim 320, float64, seq_q != seq_k, a v
    head dim of its own)."""
    monkeypatch.setenv("PIPEC_ATTENTION", "sdpa")
    torch.manual_seed(0)
    q = torch.randn(q_shape, dtype=dtype, device=DEVICE)
    k = torch.randn(kv_shape, dtype=dtype, device=DEVICE)
    v = torch.randn(*kv_shape[:3], v_dim, dtype=dtype, device=DEVICE)
    do = torch.randn(*q_shape[:3], v_dim, dtype=dtype, device=DEVICE)
    got = out_and_grads(attention, q, k, v, do, is_causal)
    want = out_and_grads(reference, *(t.double() for t in (q, k, v, do)), is_causal)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == dtype and a.shape == b.shape, name
        tol = TOL.get(dtype, 1e-12)
        assert rel(a, b) <= tol, f"{name}: relative error {rel(a, b):.2e} > {tol:.0e}"


def qkv(q_shape, kv_shape=None, dtype=torch.float32, kv_device="cpu", v_dim=None):
    q = torch.randn(q_shape, dtype=dtype)
    k = torch.randn(kv_shape or q_shape, dtype=dtype, device=kv_device)
    v = torch.randn(*k.shape[:-1], v_dim or k.shape[-1], dtype=dtype, device=kv_device)
    return q, k, v


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (qkv((1, 3, 16, 32), (1, 2, 16, 32)), r"q has 3 heads, k/v have 2.*multiple"),
        (qkv((2, 2, 16, 32), (1, 2, 16, 32)), r"do not match: q \(2, 2, 16, 32\), k \(1, 2"),
        (qkv((2, 16, 32)), r"must be 4-D.*q \(2, 16, 32\)"),
        (qkv((1, 2, 16, 32), kv_device="meta"), r"on cpu, meta, meta"),
    ],
    ids=["gqa_group", "batch", "rank", "device"],
)
def test_inputs_no_backend_takes_are_rejected_before_launch(inputs, message):
    with pytest.raises(ValueError, match=message):
        attention(*inputs)


def test_bad_backend_name_lists_the_valid_ones(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PIPEC_ATTENTION", "flash")
    with pytest.raises(ValueError, match=r"PIPEC_ATTENTION='flash'.*'triton', 'sdpa'"):
        attention(*qkv((1, 2, 16, 32)))


@pytest.mark.parametrize(
    ("inputs", "reason"),
    [
        (qkv((1, 2, 16, 8)), r"head_dim 8 \(the kernel takes 16 to 256\)"),
        (qkv((1, 2, 16, 320)), r"head_dim 320 \(the kernel takes 16 to 256\)"),
        (qkv((1, 2, 16, 32), v_dim=64), r"head_dim of v 64 != of q/k 32"),
        (qkv((1, 2, 16, 32), dtype=torch.float64), r"dtype torch\.float64 \(the kernel takes"),
        (qkv((1, 4, 16, 32), (1, 2, 24, 32)), r"seq of q 16 != seq of k/v 24"),
    ],
    ids=["head_dim_8", "head_dim_320", "v_head_dim", "float64", "seq"],
)
def test_what_the_kernel_does_not_take_runs_sdpa_with_one_notice(
    inputs, reason, monkeypatch: pytest.MonkeyPatch
):
    """Valid SDPA inputs outside the kernel give SDPA's result, and the first such call for
    each reason warns once; a model path never fails on a shape."""
    monkeypatch.setattr(dispatch, "_noticed", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = [attention(*inputs) for _ in range(3)]
    notices = [w for w in seen if issubclass(w.category, dispatch.KernelFallback)]
    assert len(notices) == 1, [str(w.message) for w in seen]
    assert re.search(reason, str(notices[0].message))
    assert notices[0].filename == __file__  # stacklevel points at the caller of attention()
    for out in got:
        torch.testing.assert_close(out, reference(*inputs, False))


def test_triton_on_cpu_without_the_interpreter_falls_back(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(flash, "INTERPRET", False)
    monkeypatch.setattr(dispatch, "_noticed", set())
    inputs = qkv((1, 2, 16, 32))
    with pytest.warns(dispatch.KernelFallback, match=r"tensors on cpu \(the kernel needs CUDA"):
        out = attention(*inputs, is_causal=True)
    torch.testing.assert_close(out, reference(*inputs, True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 80, 128, 256])
@pytest.mark.parametrize("seq", [64, 50, 1000])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_bf16_on_gpu(is_causal, head_dim, seq, heads, kv_heads):
    check_against_sdpa(torch.bfloat16, is_causal, seq, head_dim, heads, kv_heads, batch=2)
