"""Flash attention in Triton: forward and backward kernels, their tuning, and their launches.

Algorithm: FlashAttention-2 (Dao 2023, arXiv 2307.08691), the work-partitioned form of
FlashAttention (Dao et al. 2022, arXiv 2205.14135). For one (batch, head), with S = scale * Q K^T,
P = softmax(S) row by row and O = P V:

Forward. A program owns BLOCK_M query rows and streams K and V in tiles of BLOCK_N rows. It keeps
a running row max m, a running denominator l and an unnormalised accumulator; a tile that raises
the max rescales l and the accumulator by exp(m_old - m_new) (online softmax), and O = acc / l
at the end. The log-sum-exp L = m + log l (fp32, one per row) is saved: with Q, K, V and O it is
all the backward needs, so P (seq x seq) is never stored.

Backward. A preprocess kernel computes delta = rowsum(dO * O). Tiles of P = exp(S - L) are then
recomputed, and
    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta),  dQ = scale * dS K,  dK = scale * dS^T Q.
One kernel owns a K/V tile and loops over query tiles (dK, dV); another owns a query tile and
loops over K/V tiles (dQ). Each output tile has one writer: no atomics, and the gradients are
bitwise reproducible (the layout of the Triton fused-attention tutorial).

Exponentials are base 2: scores are multiplied by scale * log2(e) and L is kept in log2 units, so
every exp is an exp2 (one instruction on the GPU).

Causal masking follows SDPA's top-left convention (seq_q == seq_k, query i sees keys j <= i).
Tiles wholly below the diagonal need no causal mask, so causal loops run in two stages: the
unmasked tiles, then the band of tiles that straddle the diagonal.

Shapes. Any head dim from 16 to 256: the d axis of every tile is BLOCK_D, the next power of two
(tl.arange needs one), and when HEAD_DIM is smaller the extra columns are masked to zero on load
(they add nothing to Q K^T or to P V) and never stored. Any seq: when it is not a multiple of
both tiles (EVEN_T false) the ragged tail is masked on load and on the scores; when it is, the
masks are compiled out. Grouped-query attention: q head h reads kv head h // group, and the
dK/dV program of a kv head loops over the group's q heads, so the sum happens in registers.

Speed on the GPU. Q stays in registers while K/V tiles stream through shared memory, pipelined
num_stages deep (Triton software-pipelines the loops); P V and dS K accumulate inside tl.dot
(a wgmma accumulator on Hopper). Tile shapes, warps and pipeline depth are autotuned per
(seq, head dim, causal, dtype) from candidates listed per head-dim class (`_TILES`): large
query tiles for the forward and dQ, large key tiles for dK/dV, smaller ones as the head dim
grows and registers run short.

Under TRITON_INTERPRET=1 (CPU), dots are computed in fp32 because the interpreter's tl.dot on
bf16 operands is wrong (it multiplies bit patterns), and one fixed 64x64 tile config replaces
autotuning, which is slow when interpreted. Kernels become interpreted when they are decorated,
i.e. when this module is imported: set TRITON_INTERPRET=1 before importing it.
"""

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

INTERPRET: bool = triton.knobs.runtime.interpret
"""Whether the kernels below were decorated as interpreted (CPU) functions."""

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
"""log2(e): exp(x) == exp2(x * LOG2E)."""


@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr):
    """acc + a @ b, accumulated in fp32. DOT_FP32 makes the multiply itself fp32 (IEEE): for fp32
    inputs, so the GPU does not silently round to TF32, and under the interpreter, whose bf16
    dot is wrong."""
    if DOT_FP32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _load_rows(X, offs, T, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               TRANSPOSED: tl.constexpr, EVEN_T: tl.constexpr):  # fmt: skip
    """Rows `offs` of a contiguous (T, HEAD_DIM) matrix as a (rows, BLOCK_D) tile, zero past T
    and past HEAD_DIM; TRANSPOSED loads the (BLOCK_D, rows) view, the right operand of a dot.
    Each mask is compiled in only where it can be false."""
    offs_d = tl.arange(0, BLOCK_D)
    if TRANSPOSED:
        ptrs = X + offs[None, :] * HEAD_DIM + offs_d[:, None]
        rows, cols = offs[None, :] < T, offs_d[:, None] < HEAD_DIM
    else:
        ptrs = X + offs[:, None] * HEAD_DIM + offs_d[None, :]
        rows, cols = offs[:, None] < T, offs_d[None, :] < HEAD_DIM
    if EVEN_T and HEAD_DIM == BLOCK_D:
        tile = tl.load(ptrs)
    elif EVEN_T:
        tile = tl.load(ptrs, mask=cols, other=0.0)
    elif HEAD_DIM == BLOCK_D:
        tile = tl.load(ptrs, mask=rows, other=0.0)
    else:
        tile = tl.load(ptrs, mask=rows & cols, other=0.0)
    return tile


@triton.jit
def _store_rows(X, offs, T, tile, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store a (rows, BLOCK_D) tile into rows `offs` of a contiguous (T, HEAD_DIM) matrix,
    leaving out the rows past T and the padding columns."""
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs[:, None] < T) & (offs_d[None, :] < HEAD_DIM)
    tl.store(X + offs[:, None] * HEAD_DIM + offs_d[None, :], tile.to(X.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, K, V, offs_m, lo, hi, T, qk_scale,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BAND: tl.constexpr, EVEN_T: tl.constexpr, DOT_FP32: tl.constexpr):  # fmt: skip
    """Fold key tiles [lo, hi) into the online-softmax state (acc, l_i, m_i) of one query tile.
    BAND: the tiles straddle the diagonal, so apply the causal mask."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT = _load_rows(K, offs_n, T, HEAD_DIM, BLOCK_D, True, EVEN_T)
        s = _dot(q, kT, None, DOT_FP32) * qk_scale
        # Every row has key 0 in its first tile, so m_new is finite and exp2 never sees inf - inf.
        if BAND:
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
        if not EVEN_T:
            s = tl.where(offs_n[None, :] < T, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(V, offs_n, T, HEAD_DIM, BLOCK_D, False, EVEN_T)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_FP32)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _dkdv_tiles(dk, dv, k, v, Q, DO, LSE, DELTA, offs_n, lo, hi, T, qk_scale,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BAND: tl.constexpr, EVEN_T: tl.constexpr, DOT_FP32: tl.constexpr):  # fmt: skip
    """Add to (dk, dv) of one key tile the terms of query rows [lo, hi) of one q head, with
    P^T recomputed from the saved log-sum-exp. BAND: apply the causal mask."""
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qT = _load_rows(Q, offs_m, T, HEAD_DIM, BLOCK_D, True, EVEN_T)
        if EVEN_T:
            lse = tl.load(LSE + offs_m)
            delta = tl.load(DELTA + offs_m)
        else:
            lse = tl.load(LSE + offs_m, mask=offs_m < T, other=0.0)
            delta = tl.load(DELTA + offs_m, mask=offs_m < T, other=0.0)
        pT = tl.math.exp2(_dot(k, qT, None, DOT_FP32) * qk_scale - lse[None, :])
        if BAND:
            pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
        if not EVEN_T:
            pT = tl.where(offs_m[None, :] < T, pT, 0.0)
        do = _load_rows(DO, offs_m, T, HEAD_DIM, BLOCK_D, False, EVEN_T)
        dv = _dot(pT.to(do.dtype), do, dv, DOT_FP32)
        dsT = pT * (_dot(v, tl.trans(do), None, DOT_FP32) - delta[None, :])
        dk = _dot(dsT.to(qT.dtype), tl.trans(qT), dk, DOT_FP32)
    return dk, dv


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, K, V, offs_m, lo, hi, T, qk_scale,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              BAND: tl.constexpr, EVEN_T: tl.constexpr, DOT_FP32: tl.constexpr):  # fmt: skip
    """Add to dq of one query tile the terms of key tiles [lo, hi), with P recomputed from the
    saved log-sum-exp. BAND: apply the causal mask."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT = _load_rows(K, offs_n, T, HEAD_DIM, BLOCK_D, True, EVEN_T)
        vT = _load_rows(V, offs_n, T, HEAD_DIM, BLOCK_D, True, EVEN_T)
        p = tl.math.exp2(_dot(q, kT, None, DOT_FP32) * qk_scale - lse[:, None])
        if BAND:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        if not EVEN_T:
            p = tl.where(offs_n[None, :] < T, p, 0.0)
        ds = p * (_dot(do, vT, None, DOT_FP32) - delta[:, None])
        dq = _dot(ds.to(kT.dtype), tl.trans(kT), dq, DOT_FP32)
    return dq


# Tuning. (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates per head-dim class (BLOCK_D up to
# the key). The forward and dQ own query tiles, so theirs are tall (BLOCK_M >= BLOCK_N); dK/dV
# own key tiles, so theirs are wide. Larger head dims hold larger accumulators (BLOCK x BLOCK_D
# fp32 in registers) and K/V tiles (num_stages of them in shared memory), so their tiles shrink.
# Starting points from the Triton fused-attention tutorial (forward 128x64, 4 warps, 3-4 stages;
# backward 32x128 and 128x32) and FlashAttention-2's per-head-dim launch templates; the first of
# each list is the one taken untimed.
_TILES = {
    "fwd": {
        64: ((128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4)),
        128: ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 4, 4), (64, 32, 4, 3)),
        256: ((64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3), (32, 32, 4, 1)),
    },
    "dkdv": {
        64: ((32, 128, 4, 3), (32, 128, 4, 5), (64, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3)),
        128: ((32, 128, 4, 5), (32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 2)),
        256: ((32, 64, 8, 2), (16, 32, 4, 2), (32, 32, 4, 2), (16, 16, 4, 1)),
    },
    "dq": {
        64: ((128, 32, 4, 3), (128, 32, 4, 5), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 3)),
        128: ((128, 32, 4, 5), (128, 32, 8, 3), (128, 64, 8, 2), (64, 32, 4, 3), (64, 64, 4, 2)),
        256: ((64, 32, 8, 2), (64, 64, 8, 2), (32, 32, 4, 2), (16, 16, 4, 1)),
    },
}
_TUNE_KEY = ["T", "HEAD_DIM", "CAUSAL"]  # the autotuner adds the tensors' dtypes
Tile = tuple[int, int, int, int]


def _shared_bytes(kernel: str, tile: Tile, block_d: int, elem_bytes: int) -> int:
    """Shared memory a candidate needs, estimated: the two tiles its loop streams (K and V, or
    Q and dO), num_stages deep, plus the tiles it keeps (Q; K and V; Q and dO)."""
    m, n, _, stages = tile
    streamed, kept = {"fwd": (2 * n, m), "dkdv": (2 * m, 2 * n), "dq": (2 * n, 2 * m)}[kernel]
    return (streamed * stages + kept) * block_d * elem_bytes


def candidates(kernel: str, block_d: int, elem_bytes: int, shared_bytes: int) -> list[Tile]:
    """The kernel's candidates for a head dim whose estimated shared memory fits the device's
    (at least the smallest), in `_TILES` order; only the first when PIPEC_ATTENTION_AUTOTUNE=0
    (tests: one compile per shape instead of five, and no timing)."""
    tiles = _TILES[kernel]
    listed = tiles[min(d for d in tiles if d >= block_d)]
    need = {t: _shared_bytes(kernel, t, block_d, elem_bytes) for t in listed}
    fits = [t for t in listed if need[t] <= shared_bytes] or [min(listed, key=need.__getitem__)]
    return fits[:1] if os.environ.get("PIPEC_ATTENTION_AUTOTUNE") == "0" else fits


def _tile(c: triton.Config) -> Tile:
    return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages


def _autotune(kernel: str) -> Callable:
    """`triton.autotune` over `_TILES[kernel]`, pruned at launch to `candidates`. Under the
    interpreter a single 64x64 config: autotuning interpreted kernels is slow, and 64-wide
    tiles are the fastest to interpret."""
    if INTERPRET:
        return triton.autotune([triton.Config({"BLOCK_M": 64, "BLOCK_N": 64})], key=_TUNE_KEY)

    def prune(configs: list, named_args: dict, **kwargs: object) -> list:
        args = {**named_args, **kwargs}
        q = args["Q"]
        device = triton.runtime.driver.active.utils.get_device_properties(q.device.index)
        keep = candidates(kernel, args["BLOCK_D"], q.element_size(), device["max_shared_mem"])
        return [c for c in configs if _tile(c) in keep]

    every = sorted({t for per_dim in _TILES[kernel].values() for t in per_dim})
    configs = [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in every
    ]
    return triton.autotune(configs, key=_TUNE_KEY, prune_configs_by={"early_config_prune": prune})


_even_t = triton.heuristics(
    {"EVEN_T": lambda a: a["T"] % a["BLOCK_M"] == 0 and a["T"] % a["BLOCK_N"] == 0}
)
"""EVEN_T: seq is a multiple of both tiles, so no tile has a ragged tail to mask."""


@_autotune("fwd")
@_even_t
@triton.jit
def _attn_fwd(Q, K, V, O, LSE, sm_scale, T, H, GROUP,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
              DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              EVEN_T: tl.constexpr):  # fmt: skip
    """O and LSE for BLOCK_M query rows of one (batch, q head). Grid: (cdiv(T, BLOCK_M), B * H).
    Q, O: (B, H, T, HEAD_DIM); K, V: (B, H // GROUP, T, HEAD_DIM); LSE: (B, H, T); contiguous."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0, "the causal band must start on a key tile boundary")
    tl.static_assert(BLOCK_N >= 16, "GPU dots need tiles of at least 16")
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    kv_bh = (bh // H) * (H // GROUP) + (bh % H) // GROUP
    Q += bh.to(tl.int64) * T * HEAD_DIM
    O += bh.to(tl.int64) * T * HEAD_DIM
    LSE += bh.to(tl.int64) * T
    K += kv_bh.to(tl.int64) * T * HEAD_DIM
    V += kv_bh.to(tl.int64) * T * HEAD_DIM

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_rows(Q, offs_m, T, HEAD_DIM, BLOCK_D, False, EVEN_T)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    qk_scale = sm_scale * LOG2E

    if CAUSAL:
        band_lo = start_m * BLOCK_M
        band_hi = tl.minimum(band_lo + BLOCK_M, T)
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K, V, offs_m, 0, band_lo, T, qk_scale,
                                   BLOCK_N, HEAD_DIM, BLOCK_D, False, EVEN_T, DOT_FP32)  # fmt: skip
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K, V, offs_m, band_lo, band_hi, T, qk_scale,
                                   BLOCK_N, HEAD_DIM, BLOCK_D, True, EVEN_T, DOT_FP32)  # fmt: skip
    else:
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K, V, offs_m, 0, T, T, qk_scale,
                                   BLOCK_N, HEAD_DIM, BLOCK_D, False, EVEN_T, DOT_FP32)  # fmt: skip
    tl.store(LSE + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < T)
    _store_rows(O, offs_m, T, acc / l_i[:, None], HEAD_DIM, BLOCK_D)


@triton.jit
def _attn_bwd_preprocess(O, DO, DELTA, T, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_M: tl.constexpr):  # fmt: skip
    """delta = rowsum(dO * O) in fp32 for BLOCK_M rows. Grid: (cdiv(T, BLOCK_M), B * H)."""
    bh = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    q_off = bh.to(tl.int64) * T * HEAD_DIM
    o = _load_rows(O + q_off, offs_m, T, HEAD_DIM, BLOCK_D, False, False).to(tl.float32)
    do = _load_rows(DO + q_off, offs_m, T, HEAD_DIM, BLOCK_D, False, False).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * T + offs_m, tl.sum(o * do, 1), mask=offs_m < T)


@_autotune("dkdv")
@_even_t
@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA, sm_scale, T, H, GROUP,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                   DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   EVEN_T: tl.constexpr):  # fmt: skip
    """dK and dV for BLOCK_N keys of one (batch, kv head), summed over the GROUP q heads that
    share it. Grid: (cdiv(T, BLOCK_N), B * H // GROUP). Layouts as in _attn_fwd."""
    tl.static_assert(BLOCK_N % BLOCK_M == 0, "the causal band must end on a query tile boundary")
    tl.static_assert(BLOCK_M >= 16, "GPU dots need tiles of at least 16")
    start_n = tl.program_id(0)
    kv_bh = tl.program_id(1)
    kv_heads = H // GROUP
    kv_off = kv_bh.to(tl.int64) * T * HEAD_DIM
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = _load_rows(K + kv_off, offs_n, T, HEAD_DIM, BLOCK_D, False, EVEN_T)
    v = _load_rows(V + kv_off, offs_n, T, HEAD_DIM, BLOCK_D, False, EVEN_T)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E

    for g in range(GROUP):
        bh = ((kv_bh // kv_heads) * H + (kv_bh % kv_heads) * GROUP + g).to(tl.int64)
        Qh = Q + bh * T * HEAD_DIM
        DOh = DO + bh * T * HEAD_DIM
        LSEh = LSE + bh * T
        DELTAh = DELTA + bh * T
        if CAUSAL:
            band_lo = start_n * BLOCK_N
            band_hi = tl.minimum(band_lo + BLOCK_N, T)
            dk, dv = _dkdv_tiles(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, offs_n, band_lo, band_hi, T,
                                 qk_scale, BLOCK_M, HEAD_DIM, BLOCK_D, True, EVEN_T,
                                 DOT_FP32)  # fmt: skip
            dk, dv = _dkdv_tiles(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, offs_n, band_hi, T, T,
                                 qk_scale, BLOCK_M, HEAD_DIM, BLOCK_D, False, EVEN_T,
                                 DOT_FP32)  # fmt: skip
        else:
            dk, dv = _dkdv_tiles(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, offs_n, 0, T, T,
                                 qk_scale, BLOCK_M, HEAD_DIM, BLOCK_D, False, EVEN_T,
                                 DOT_FP32)  # fmt: skip
    _store_rows(DK + kv_off, offs_n, T, dk * sm_scale, HEAD_DIM, BLOCK_D)
    _store_rows(DV + kv_off, offs_n, T, dv, HEAD_DIM, BLOCK_D)


@_autotune("dq")
@_even_t
@triton.jit
def _attn_bwd_dq(Q, K, V, DO, DQ, LSE, DELTA, sm_scale, T, H, GROUP,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                 DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 EVEN_T: tl.constexpr):  # fmt: skip
    """dQ for BLOCK_M query rows of one (batch, q head). Grid: (cdiv(T, BLOCK_M), B * H)."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0, "the causal band must start on a key tile boundary")
    tl.static_assert(BLOCK_N >= 16, "GPU dots need tiles of at least 16")
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    kv_bh = (bh // H) * (H // GROUP) + (bh % H) // GROUP
    q_off = bh.to(tl.int64) * T * HEAD_DIM
    K += kv_bh.to(tl.int64) * T * HEAD_DIM
    V += kv_bh.to(tl.int64) * T * HEAD_DIM

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_rows(Q + q_off, offs_m, T, HEAD_DIM, BLOCK_D, False, EVEN_T)
    do = _load_rows(DO + q_off, offs_m, T, HEAD_DIM, BLOCK_D, False, EVEN_T)
    lse = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=offs_m < T, other=0.0)
    delta = tl.load(DELTA + bh.to(tl.int64) * T + offs_m, mask=offs_m < T, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E

    if CAUSAL:
        band_lo = start_m * BLOCK_M
        band_hi = tl.minimum(band_lo + BLOCK_M, T)
        dq = _dq_tiles(dq, q, do, lse, delta, K, V, offs_m, 0, band_lo, T, qk_scale,
                       BLOCK_N, HEAD_DIM, BLOCK_D, False, EVEN_T, DOT_FP32)  # fmt: skip
        dq = _dq_tiles(dq, q, do, lse, delta, K, V, offs_m, band_lo, band_hi, T, qk_scale,
                       BLOCK_N, HEAD_DIM, BLOCK_D, True, EVEN_T, DOT_FP32)  # fmt: skip
    else:
        dq = _dq_tiles(dq, q, do, lse, delta, K, V, offs_m, 0, T, T, qk_scale,
                       BLOCK_N, HEAD_DIM, BLOCK_D, False, EVEN_T, DOT_FP32)  # fmt: skip
    _store_rows(DQ + q_off, offs_m, T, dq * sm_scale, HEAD_DIM, BLOCK_D)


def _grid(T: int, programs: int, tile: str) -> Callable[[dict], tuple[int, int]]:
    """Launch grid: one program per `tile`-sized slice of the sequence, per (batch, head)."""
    return lambda meta: (triton.cdiv(T, meta[tile]), programs)


def _shape_args(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """(B, H, T, group, HEAD_DIM, BLOCK_D) of a launch."""
    B, H, T, D = q.shape
    return B, H, T, H // k.shape[1], D, max(16, triton.next_power_of_2(D))


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L): the attention output and the fp32 log-sum-exp per query row (base 2), all that
    `backward` needs beside Q, K, V. Takes what `supports` accepts; the dispatcher
    (`runtime.kernels.attention`) checks that first."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, H, T, group, D, block_d = _shape_args(q, k)
    o = torch.empty_like(q)
    lse = torch.empty((B, H, T), device=q.device, dtype=torch.float32)
    _attn_fwd[_grid(T, B * H, "BLOCK_M")](
        q, k, v, o, lse, scale, T, H, group,
        HEAD_DIM=D, BLOCK_D=block_d, CAUSAL=is_causal, DOT_FP32=_dot_fp32(q),
    )  # fmt: skip
    return o, lse


def backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) from the upstream gradient dO and `forward`'s inputs and results: the
    preprocess, dK/dV and dQ kernels."""
    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous()
    B, H, T, group, D, block_d = _shape_args(q, k)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty_like(lse)
    _attn_bwd_preprocess[(triton.cdiv(T, 64), B * H)](
        o, do, delta, T, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=64
    )
    meta = {"HEAD_DIM": D, "BLOCK_D": block_d, "CAUSAL": is_causal, "DOT_FP32": _dot_fp32(q)}
    _attn_bwd_dkdv[_grid(T, B * H // group, "BLOCK_N")](
        q, k, v, do, dk, dv, lse, delta, scale, T, H, group, **meta
    )
    _attn_bwd_dq[_grid(T, B * H, "BLOCK_M")](
        q, k, v, do, dq, lse, delta, scale, T, H, group, **meta
    )
    return dq, dk, dv


def _dot_fp32(q: torch.Tensor) -> bool:
    """Whether dots multiply in fp32: fp32 inputs (no silent TF32), or interpreted (see _dot)."""
    return INTERPRET or q.dtype == torch.float32


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when the kernel takes these (valid, same-device, same-dtype) inputs; else why not,
    in a few words that name the value (the dispatcher's notice)."""
    if not MIN_HEAD_DIM <= q.shape[3] <= MAX_HEAD_DIM:
        return f"head_dim {q.shape[3]} (the kernel takes {MIN_HEAD_DIM} to {MAX_HEAD_DIM})"
    if v.shape[3] != q.shape[3]:
        return f"head_dim of v {v.shape[3]} != of q/k {q.shape[3]} (the kernel needs one)"
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (the kernel takes {', '.join(map(str, DTYPES))})"
    if q.shape[2] != k.shape[2]:
        return f"seq of q {q.shape[2]} != seq of k/v {k.shape[2]} (the kernel needs one)"
    if not q.is_cuda and not INTERPRET:
        return (
            f"tensors on {q.device.type} (the kernel needs CUDA, or TRITON_INTERPRET=1 set "
            "before pipec.runtime.kernels is imported)"
        )
    return None
