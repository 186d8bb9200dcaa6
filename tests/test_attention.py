"""The Triton flash-attention kernel vs SDPA: outputs, gradients, GQA, a toy GPT, bad inputs.

Without CUDA the kernels run under the Triton interpreter on CPU tensors; with CUDA they are
compiled and the same tests run on the GPU, plus the bf16 test marked `gpu`.

Relative error: rel(a, b) = max|a - b| / max|b|, b being the reference: SDPA run in float64 on
the same inputs (upcast exactly), so the number measures the kernel's error alone. Bounds: fp32
1e-5, fp16 2e-3, bf16 3e-2 (bf16 has 8 mantissa bits; the errors measured are about 1e-2).
"""

import os
import sys

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # Triton decides to interpret a kernel when it is decorated, i.e. when runtime.kernels is
    # first imported: this must come before that import.
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch.nn.functional as F
from torch import nn

from runtime.kernels import attention

kernel_module = sys.modules["runtime.kernels.attention"]
if DEVICE == "cpu" and not kernel_module.INTERPRET:
    pytest.skip(
        "runtime.kernels was imported (by an earlier test module) before this module set "
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


def test_matches_sdpa_head_dim_128():
    check_against_sdpa(torch.float16, True, seq=50, head_dim=128)


@pytest.mark.parametrize(
    ("dtype", "is_causal", "seq", "heads", "kv_heads"),
    [
        (torch.float32, True, 50, 4, 2),
        (torch.float32, False, 150, 3, 1),
        (torch.float16, True, 64, 4, 1),
    ],
)
def test_gqa_matches_sdpa(dtype, is_causal, seq, heads, kv_heads):
    """dK/dV of a kv head are the sums over its group of q heads."""
    check_against_sdpa(dtype, is_causal, seq, 32, heads=heads, kv_heads=kv_heads, batch=2)


def test_bf16_interpreted_dots_are_fp32():
    """The interpreter's bf16 tl.dot is wrong; the kernel must upcast before it."""
    check_against_sdpa(torch.bfloat16, True, seq=50, head_dim=32)


def test_sdpa_backend_handles_gqa(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PIPEC_ATTENTION", "sdpa")
    q, k, v = torch.randn(1, 4, 8, 32), torch.randn(1, 2, 8, 32), torch.randn(1, 2, 8, 32)
    torch.testing.assert_close(attention(q, k, v, is_causal=True), reference(q, k, v, True))


def test_default_backend_is_sdpa_on_cpu(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("PIPEC_ATTENTION")
    assert kernel_module._backend(torch.empty(0)) == "sdpa"


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


def qkv(q_shape, kv_shape=None, dtype=torch.float32, kv_device="cpu"):
    q = torch.empty(q_shape, dtype=dtype)
    k = torch.empty(kv_shape or q_shape, dtype=dtype, device=kv_device)
    return q, k, torch.empty_like(k)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (qkv((1, 2, 16, 48)), r"head_dim of q/k 48.*\(32, 64, 128\)"),
        (qkv((1, 2, 16, 32), dtype=torch.float64), r"torch\.float64.*torch\.float16"),
        (qkv((1, 3, 16, 32), (1, 2, 16, 32)), r"q has 3 heads, k/v have 2.*multiple"),
        (qkv((1, 2, 16, 32), (1, 2, 8, 32)), r"seq of q 16 != seq of k/v 8"),
        (qkv((2, 2, 16, 32), (1, 2, 16, 32)), r"do not match: q \(2, 2, 16, 32\), k \(1, 2"),
        (qkv((2, 16, 32)), r"must be 4-D.*q \(2, 16, 32\)"),
        (qkv((1, 2, 16, 32), kv_device="meta"), r"on cpu, meta, meta"),
    ],
    ids=["head_dim", "dtype", "gqa_group", "seq", "batch", "rank", "device"],
)
def test_bad_inputs_are_rejected_before_launch(inputs, message):
    with pytest.raises(ValueError, match=message):
        attention(*inputs)


def test_bad_backend_name_lists_the_valid_ones(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PIPEC_ATTENTION", "flash")
    with pytest.raises(ValueError, match=r"PIPEC_ATTENTION='flash'.*'triton', 'sdpa'"):
        attention(*qkv((1, 2, 16, 32)))


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(kernel_module, "INTERPRET", False)
    with pytest.raises(ValueError, match=r"needs CUDA tensors, or TRITON_INTERPRET=1"):
        attention(*qkv((1, 2, 16, 32)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("seq", [64, 50, 1000])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_bf16_on_gpu(is_causal, head_dim, seq, heads, kv_heads):
    check_against_sdpa(torch.bfloat16, is_causal, seq, head_dim, heads, kv_heads, batch=2)
