"""The Triton flash attention against SDPA's flash backend: forward and backward speed, bf16.

Shapes: batch 4, 16 heads, head dim 64 and 128, seq 1k, 4k and 8k, causal and not. For each row
the two backends run back to back on the same inputs (`triton.testing.do_bench`, median, after
the kernel's autotuning): the forward alone, then the backward alone (retained graph, gradients
reset between runs), reported as TFLOP/s and as the ratio ours / SDPA flash. The goal: both
ratios >= 0.9 at seq 4k, head dim 128.

FLOPs: forward 4*B*H*T^2*d (Q K^T and P V, 2 FLOPs per multiply-add), halved when causal;
backward 2.5x forward (five T^2*d matmuls, the recompute of Q K^T counted), the convention of
the Triton fused-attention tutorial. Before timing, the kernel's output and gradients are
checked against SDPA.

    PYTHONPATH=$PWD python bench/attention.py [--seqs 1024,4096,8192] [--json out.json]

Without CUDA it says so and exits 0 having measured nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's pipec, bench and examples, installed or not

from pipec.runtime.kernels import attention, flash

BATCH, HEADS = 4, 16
HEAD_DIMS = (64, 128)
SEQS = (1024, 4096, 8192)
GOAL = {"seq": 4096, "head_dim": 128, "ratio": 0.9}
BF16_TOL = 3e-2  # max|a - b| / max|b|, as in tests/test_attention.py


def flops(seq: int, head_dim: int, is_causal: bool, mode: str) -> float:
    fwd = 4 * BATCH * HEADS * seq * seq * head_dim / (2 if is_causal else 1)
    return fwd * (2.5 if mode == "bwd" else 1.0)


def ms_per_run(fn, q, k, v, is_causal: bool, mode: str) -> float:
    """Median milliseconds of `fn`'s forward, or of the backward of one stored forward."""
    import triton.testing

    if mode == "fwd":
        return triton.testing.do_bench(lambda: fn(q, k, v, is_causal), return_mode="median")
    out = fn(q, k, v, is_causal)
    do = torch.randn_like(out)
    return triton.testing.do_bench(
        lambda: out.backward(do, retain_graph=True), grad_to_none=[q, k, v], return_mode="median"
    )


def sdpa_flash(q, k, v, is_causal: bool) -> torch.Tensor:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def out_and_grads(fn, q, k, v, do, is_causal: bool) -> tuple[torch.Tensor, ...]:
    out = fn(q, k, v, is_causal)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def check(ours, head_dim: int) -> None:
    """Refuse to time a kernel whose output or gradients disagree with SDPA."""
    shape = (BATCH, HEADS, SEQS[0], head_dim)  # the first row's: tuned here for it
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "qkv"
    )
    do = torch.randn_like(q)
    for is_causal in (False, True):
        got = out_and_grads(ours, q, k, v, do, is_causal)
        want = out_and_grads(sdpa_flash, q, k, v, do, is_causal)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            if err > BF16_TOL:
                sys.exit(
                    f"bench/attention.py: the kernel's {name} differs from SDPA at head dim "
                    f"{head_dim}, causal {is_causal} (relative error {err:.1e})"
                )


def measure(seqs: tuple[int, ...]) -> list[dict]:
    rows = []
    for head_dim in HEAD_DIMS:
        check(attention, head_dim)
        for is_causal in (False, True):
            for seq in seqs:
                shape = (BATCH, HEADS, seq, head_dim)
                q, k, v = (
                    torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    for _ in "qkv"
                )
                for mode in ("fwd", "bwd"):
                    ours = ms_per_run(attention, q, k, v, is_causal, mode)
                    theirs = ms_per_run(sdpa_flash, q, k, v, is_causal, mode)
                    work = flops(seq, head_dim, is_causal, mode)
                    row = {"head_dim": head_dim, "causal": is_causal, "seq": seq, "mode": mode}
                    row |= {"triton_ms": ours, "sdpa_flash_ms": theirs, "ratio": theirs / ours}
                    row |= {"triton_tflops": work / ours / 1e9, "sdpa_tflops": work / theirs / 1e9}
                    rows.append(row)
                    print(
                        f"{head_dim:>4} {is_causal!s:>6} {seq:>6} {mode:>4} "
                        f"{row['triton_tflops']:>8.1f} {row['sdpa_tflops']:>10.1f} "
                        f"{row['ratio']:>6.2f}",
                        flush=True,
                    )
    return rows


def goal_met(rows: list[dict]) -> bool | None:
    """Whether every ratio at the goal's seq and head dim reaches the goal (None: not measured)."""
    at = [r for r in rows if r["seq"] == GOAL["seq"] and r["head_dim"] == GOAL["head_dim"]]
    return all(r["ratio"] >= GOAL["ratio"] for r in at) if at else None


def chosen_tiles() -> dict[str, str]:
    """The configs autotuning chose last, per kernel: where tuning would start."""
    kernels = {"fwd": flash._attn_fwd, "dkdv": flash._attn_bwd_dkdv, "dq": flash._attn_bwd_dq}
    return {name: str(getattr(k, "best_config", None)) for name, k in kernels.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default=",".join(map(str, SEQS)), help="sequence lengths")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/attention.py: skipped: needs a CUDA GPU and torch sees none; nothing measured")
        return 0
    import triton

    os.environ["PIPEC_ATTENTION"] = "triton"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(
        f"bf16, batch {BATCH}, {HEADS} heads; TFLOP/s (FLOPs in the docstring); ratio = ours/sdpa"
    )
    head = ("d", 4), ("causal", 6), ("seq", 6), ("mode", 4), ("triton", 8), ("sdpa-flash", 10)
    print(" ".join(f"{name:>{width}}" for name, width in head), f"{'ratio':>6}")
    rows = measure(tuple(int(s) for s in args.seqs.split(",")))
    met = goal_met(rows)
    tiles = chosen_tiles()
    print("last autotuned tiles:", "; ".join(f"{k} {v}" for k, v in tiles.items()))
    goal = f"fwd and bwd ratio >= {GOAL['ratio']} at seq {GOAL['seq']}, head dim {GOAL['head_dim']}"
    print(f"goal ({goal}):", {True: "met", False: "MISSED", None: "not measured"}[met])
    if args.json:
        device = torch.cuda.get_device_name()
        args.json.write_text(
            json.dumps({"device": device, "rows": rows, "goal_met": met, "tiles": tiles}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
