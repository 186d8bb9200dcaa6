"""Forward and forward+backward TFLOP/s of the Triton flash attention vs SDPA's flash backend.

Shapes: bf16, head_dim 128, batch 4 x heads 8 (B*H = 32 fixed), seq 1k to 16k, causal and not.
FLOPs: forward 4*B*H*T^2*d (Q K^T and P V, 2 FLOPs per multiply-add), halved when causal;
forward+backward 3.5x forward (the backward's five T^2*d matmuls, counting the recompute of
Q K^T, are 2.5x the forward's two), the convention of the Triton fused-attention tutorial.
Times: median over the runs `triton.testing.do_bench` fits in 100 ms, after autotuning; the two
backends run back to back for each row. Before timing, the kernel's output is checked against SDPA.

Run from the repository root: PYTHONPATH=$PWD python bench/attention.py
"""

import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from runtime.kernels import attention

BATCH, HEADS, HEAD_DIM = 4, 8, 128
SEQS = (1024, 2048, 4096, 8192, 16384)
BF16_TOL = 3e-2  # max|a - b| / max|b|, as in tests/test_attention.py


def flops(seq: int, is_causal: bool, mode: str) -> float:
    fwd = 4 * BATCH * HEADS * seq * seq * HEAD_DIM / (2 if is_causal else 1)
    return fwd * (3.5 if mode == "fwd+bwd" else 1.0)


def triton_attention(q, k, v, is_causal: bool) -> torch.Tensor:
    return attention(q, k, v, is_causal=is_causal)


def sdpa_flash(q, k, v, is_causal: bool) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def tflops(fn, seq: int, is_causal: bool, mode: str) -> float:
    """TFLOP/s of `fn` (forward, or forward then backward) on fresh bf16 inputs."""
    shape = (BATCH, HEADS, seq, HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
    q, k, v = q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    do = torch.randn_like(q)

    def step() -> None:
        out = fn(q, k, v, is_causal)
        if mode == "fwd+bwd":
            out.backward(do)

    ms = triton.testing.do_bench(step, grad_to_none=[q, k, v], return_mode="median")
    return flops(seq, is_causal, mode) / (ms * 1e-3) / 1e12


def check() -> None:
    """Refuse to time a kernel that disagrees with SDPA."""
    q, k, v = (
        torch.randn(2, 4, 1000, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in "qkv"
    )
    for is_causal in (False, True):
        got = attention(q, k, v, is_causal=is_causal).float()
        want = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        if err > BF16_TOL:
            sys.exit(f"bench/attention.py: the kernel differs from SDPA (relative error {err:.1e})")


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/attention.py: needs a CUDA GPU (none available here); nothing measured.")
        return 0
    os.environ["PIPEC_ATTENTION"] = "triton"
    check()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"bf16, batch {BATCH} x heads {HEADS}, head_dim {HEAD_DIM}; TFLOP/s (FLOPs in docstring)")
    print(f"{'causal':>6} {'seq':>6} {'mode':>8} {'triton':>8} {'sdpa-flash':>10} {'ratio':>6}")
    for is_causal in (False, True):
        for seq in SEQS:
            for mode in ("fwd", "fwd+bwd"):
                ours = tflops(triton_attention, seq, is_causal, mode)
                theirs = tflops(sdpa_flash, seq, is_causal, mode)
                ratio = ours / theirs
                print(
                    f"{is_causal!s:>6} {seq:>6} {mode:>8} {ours:>8.1f} {theirs:>10.1f} "
                    f"{ratio:>6.2f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
