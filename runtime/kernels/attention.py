"""Flash attention in Triton: forward and backward kernels, the autograd function, the dispatcher.

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
loops over K/V tiles (dQ). Each output tile has one writer, so no atomics are needed.

Exponentials are base 2: scores are multiplied by scale * log2(e) and L is kept in log2 units, so
every exp is an exp2 (one instruction on the GPU).

Causal masking follows SDPA's top-left convention (seq_q == seq_k, query i sees keys j <= i).
Tiles wholly below the diagonal need no causal mask, so causal loops run in two stages: the
unmasked tiles, then the band of tiles that straddle the diagonal. A ragged tail (seq not a
multiple of the tile) is masked on load and on the scores in every stage.

Grouped-query attention: q head h reads kv head h // group. The dK/dV program of a kv head loops
over the group's q heads, so the sum over the group happens in registers.

Under TRITON_INTERPRET=1 (CPU), dots are computed in fp32 because the interpreter's tl.dot on
bf16 operands is wrong (it multiplies bit patterns), and one fixed 64x64 tile config replaces
autotuning, which is slow when interpreted. Kernels become interpreted when they are decorated,
i.e. when this module is imported: set TRITON_INTERPRET=1 before importing it.
"""

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

INTERPRET: bool = triton.knobs.runtime.interpret
"""Whether the kernels below were decorated as interpreted (CPU) functions."""

HEAD_DIMS = (32, 64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS = ("triton", "sdpa")
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
"""log2(e): exp(x) == exp2(x * LOG2E)."""


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    """a @ b accumulated in fp32. DOT_FP32 makes the multiply itself fp32 (IEEE): for fp32 inputs,
    so the GPU does not silently round to TF32, and under the interpreter, whose bf16 dot is
    wrong."""
    if DOT_FP32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _load_rows(X, offs, T, HEAD_DIM: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Rows `offs` of a contiguous (T, HEAD_DIM) matrix, zero past T (the ragged tail);
    TRANSPOSED loads the (HEAD_DIM, rows) view, the right operand of a dot."""
    offs_d = tl.arange(0, HEAD_DIM)
    in_seq = offs < T
    if TRANSPOSED:
        ptrs, mask = X + offs[None, :] * HEAD_DIM + offs_d[:, None], in_seq[None, :]
    else:
        ptrs, mask = X + offs[:, None] * HEAD_DIM + offs_d[None, :], in_seq[:, None]
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, K, V, offs_m, lo, hi, T, qk_scale,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BAND: tl.constexpr,
               DOT_FP32: tl.constexpr):  # fmt: skip
    """Fold key tiles [lo, hi) into the online-softmax state (acc, l_i, m_i) of one query tile.
    BAND: the tiles straddle the diagonal, so apply the causal mask."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_seq = offs_n < T
        kT = _load_rows(K, offs_n, T, HEAD_DIM, True)
        s = _dot(q, kT, DOT_FP32) * qk_scale
        keep = in_seq[None, :]
        if BAND:
            keep = keep & (offs_m[:, None] >= offs_n[None, :])
        # Every row has key 0 in its first tile, so m_new is finite and exp2 never sees inf - inf.
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(V, offs_n, T, HEAD_DIM, False)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _dkdv_tiles(dk, dv, k, v, Q, DO, LSE, DELTA, offs_n, lo, hi, T, qk_scale,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BAND: tl.constexpr,
                DOT_FP32: tl.constexpr):  # fmt: skip
    """Add to (dk, dv) of one key tile the terms of query rows [lo, hi) of one q head, with
    P^T recomputed from the saved log-sum-exp. BAND: apply the causal mask."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        in_seq = offs_m < T
        qT = _load_rows(Q, offs_m, T, HEAD_DIM, True)
        lse = tl.load(LSE + offs_m, mask=in_seq, other=0.0)
        pT = tl.math.exp2(_dot(k, qT, DOT_FP32) * qk_scale - lse[None, :])
        keep = in_seq[None, :]
        if BAND:
            keep = keep & (offs_m[None, :] >= offs_n[:, None])
        pT = tl.where(keep, pT, 0.0)
        do = _load_rows(DO, offs_m, T, HEAD_DIM, False)
        dv += _dot(pT.to(do.dtype), do, DOT_FP32)
        delta = tl.load(DELTA + offs_m, mask=in_seq, other=0.0)
        dsT = pT * (_dot(v, tl.trans(do), DOT_FP32) - delta[None, :])
        dk += _dot(dsT.to(qT.dtype), tl.trans(qT), DOT_FP32)
    return dk, dv


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, K, V, offs_m, lo, hi, T, qk_scale,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BAND: tl.constexpr,
              DOT_FP32: tl.constexpr):  # fmt: skip
    """Add to dq of one query tile the terms of key tiles [lo, hi), with P recomputed from the
    saved log-sum-exp. BAND: apply the causal mask."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_seq = offs_n < T
        kT = _load_rows(K, offs_n, T, HEAD_DIM, True)
        vT = _load_rows(V, offs_n, T, HEAD_DIM, True)
        p = tl.math.exp2(_dot(q, kT, DOT_FP32) * qk_scale - lse[:, None])
        keep = in_seq[None, :]
        if BAND:
            keep = keep & (offs_m[:, None] >= offs_n[None, :])
        p = tl.where(keep, p, 0.0)
        ds = p * (_dot(do, vT, DOT_FP32) - delta[:, None])
        dq += _dot(ds.to(kT.dtype), tl.trans(kT), DOT_FP32)
    return dq


def _configs(gpu: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) candidates to autotune on the GPU; under the
    interpreter a single 64x64 config, because autotuning interpreted kernels is slow and 64-wide
    tiles are the fastest to interpret."""
    tiles = [(64, 64, 4, 1)] if INTERPRET else gpu
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in tiles
    ]


_TUNE_KEY = ["T", "HEAD_DIM", "CAUSAL"]


@triton.autotune(
    _configs([(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 4)]),
    key=_TUNE_KEY,
)
@triton.jit
def _attn_fwd(Q, K, V, O, LSE, sm_scale, T, H, GROUP,
              HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
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
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    in_seq = offs_m < T
    q = _load_rows(Q, offs_m, T, HEAD_DIM, False)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    qk_scale = sm_scale * LOG2E

    if CAUSAL:
        band_lo = start_m * BLOCK_M
        band_hi = tl.minimum(band_lo + BLOCK_M, T)
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K, V, offs_m, 0, band_lo, T, qk_scale,
                                   BLOCK_N, HEAD_DIM, False, DOT_FP32)  # fmt: skip
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K, V, offs_m, band_lo, band_hi, T, qk_scale,
                                   BLOCK_N, HEAD_DIM, True, DOT_FP32)  # fmt: skip
    else:
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K, V, offs_m, 0, T, T, qk_scale,
                                   BLOCK_N, HEAD_DIM, False, DOT_FP32)  # fmt: skip
    tl.store(LSE + offs_m, m_i + tl.math.log2(l_i), mask=in_seq)
    tl.store(O + rows, (acc / l_i[:, None]).to(O.dtype.element_ty), mask=in_seq[:, None])


@triton.jit
def _attn_bwd_preprocess(O, DO, DELTA, T, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O) in fp32 for BLOCK_M rows. Grid: (cdiv(T, BLOCK_M), B * H)."""
    bh = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    q_off = bh.to(tl.int64) * T * HEAD_DIM
    o = _load_rows(O + q_off, offs_m, T, HEAD_DIM, False).to(tl.float32)
    do = _load_rows(DO + q_off, offs_m, T, HEAD_DIM, False).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * T + offs_m, tl.sum(o * do, 1), mask=offs_m < T)


@triton.autotune(
    _configs([(32, 64, 4, 3), (32, 128, 4, 3), (32, 128, 8, 3), (64, 128, 8, 3), (64, 64, 4, 3)]),
    key=_TUNE_KEY,
)
@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA, sm_scale, T, H, GROUP,
                   HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """dK and dV for BLOCK_N keys of one (batch, kv head), summed over the GROUP q heads that
    share it. Grid: (cdiv(T, BLOCK_N), B * H // GROUP). Layouts as in _attn_fwd."""
    tl.static_assert(BLOCK_N % BLOCK_M == 0, "the causal band must end on a query tile boundary")
    tl.static_assert(BLOCK_M >= 16, "GPU dots need tiles of at least 16")
    start_n = tl.program_id(0)
    kv_bh = tl.program_id(1)
    kv_heads = H // GROUP
    kv_off = kv_bh.to(tl.int64) * T * HEAD_DIM
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    in_seq = offs_n < T
    k = _load_rows(K + kv_off, offs_n, T, HEAD_DIM, False)
    v = _load_rows(V + kv_off, offs_n, T, HEAD_DIM, False)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
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
                                 qk_scale, BLOCK_M, HEAD_DIM, True, DOT_FP32)  # fmt: skip
            dk, dv = _dkdv_tiles(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, offs_n, band_hi, T, T,
                                 qk_scale, BLOCK_M, HEAD_DIM, False, DOT_FP32)  # fmt: skip
        else:
            dk, dv = _dkdv_tiles(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, offs_n, 0, T, T,
                                 qk_scale, BLOCK_M, HEAD_DIM, False, DOT_FP32)  # fmt: skip
    tl.store(DK + kv_off + rows, (dk * sm_scale).to(DK.dtype.element_ty), mask=in_seq[:, None])
    tl.store(DV + kv_off + rows, dv.to(DV.dtype.element_ty), mask=in_seq[:, None])


@triton.autotune(
    _configs([(64, 32, 4, 3), (128, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3)]),
    key=_TUNE_KEY,
)
@triton.jit
def _attn_bwd_dq(Q, K, V, DO, DQ, LSE, DELTA, sm_scale, T, H, GROUP,
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
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
    offs_d = tl.arange(0, HEAD_DIM)
    rows = q_off + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    in_seq = offs_m < T
    q = _load_rows(Q + q_off, offs_m, T, HEAD_DIM, False)
    do = _load_rows(DO + q_off, offs_m, T, HEAD_DIM, False)
    lse = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=in_seq, other=0.0)
    delta = tl.load(DELTA + bh.to(tl.int64) * T + offs_m, mask=in_seq, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E

    if CAUSAL:
        band_lo = start_m * BLOCK_M
        band_hi = tl.minimum(band_lo + BLOCK_M, T)
        dq = _dq_tiles(dq, q, do, lse, delta, K, V, offs_m, 0, band_lo, T, qk_scale,
                       BLOCK_N, HEAD_DIM, False, DOT_FP32)  # fmt: skip
        dq = _dq_tiles(dq, q, do, lse, delta, K, V, offs_m, band_lo, band_hi, T, qk_scale,
                       BLOCK_N, HEAD_DIM, True, DOT_FP32)  # fmt: skip
    else:
        dq = _dq_tiles(dq, q, do, lse, delta, K, V, offs_m, 0, T, T, qk_scale,
                       BLOCK_N, HEAD_DIM, False, DOT_FP32)  # fmt: skip
    tl.store(DQ + rows, (dq * sm_scale).to(DQ.dtype.element_ty), mask=in_seq[:, None])


def _grid(T: int, programs: int, tile: str) -> Callable[[dict], tuple[int, int]]:
    """Launch grid: one program per `tile`-sized slice of the sequence, per (batch, head)."""
    return lambda meta: (triton.cdiv(T, meta[tile]), programs)


class _FlashAttention(torch.autograd.Function):
    """Autograd glue: forward saves (q, k, v, o, lse); backward runs preprocess, dK/dV, dQ."""

    @staticmethod
    def forward(
        ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float
    ) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        B, H, T, D = q.shape
        group = H // k.shape[1]
        o = torch.empty_like(q)
        lse = torch.empty((B, H, T), device=q.device, dtype=torch.float32)
        dot_fp32 = INTERPRET or q.dtype == torch.float32
        _attn_fwd[_grid(T, B * H, "BLOCK_M")](
            q, k, v, o, lse, scale, T, H, group,
            HEAD_DIM=D, CAUSAL=is_causal, DOT_FP32=dot_fp32,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal, ctx.scale, ctx.dot_fp32 = is_causal, scale, dot_fp32
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, o, lse = ctx.saved_tensors
        do = do.contiguous()
        B, H, T, D = q.shape
        group = H // k.shape[1]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        delta = torch.empty_like(lse)
        _attn_bwd_preprocess[(triton.cdiv(T, 64), B * H)](o, do, delta, T, HEAD_DIM=D, BLOCK_M=64)
        meta = {"HEAD_DIM": D, "CAUSAL": ctx.is_causal, "DOT_FP32": ctx.dot_fp32}
        _attn_bwd_dkdv[_grid(T, B * H // group, "BLOCK_N")](
            q, k, v, do, dk, dv, lse, delta, ctx.scale, T, H, group, **meta
        )
        _attn_bwd_dq[_grid(T, B * H, "BLOCK_M")](
            q, k, v, do, dq, lse, delta, ctx.scale, T, H, group, **meta
        )
        return dq, dk, dv, None, None


def _shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Checks every backend needs: the layout (batch, heads, seq, head_dim) and GQA grouping."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention: q, k, v must be 4-D (batch, heads, seq, head_dim); got {_shapes(q, k, v)}"
        )
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"attention: shapes do not match: {_shapes(q, k, v)}; k and v need the same batch, "
            "heads and seq, and q the same batch and head_dim as k"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"attention: q has {q.shape[1]} heads, k/v have {k.shape[1]} ({_shapes(q, k, v)}); "
            "q heads must be a multiple of k/v heads (grouped-query attention)"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"attention: q, k, v are on {q.device}, {k.device}, {v.device}; put them on one device"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"attention: q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; use one dtype"
        )


def _check_kernel_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """What the Triton kernel supports beyond `_check_inputs`, with the fix in each message."""
    hint = "; or set PIPEC_ATTENTION=sdpa"
    if q.shape[3] not in HEAD_DIMS or v.shape[3] != q.shape[3]:
        raise ValueError(
            f"attention: head_dim of q/k {q.shape[3]}, of v {v.shape[3]} ({_shapes(q, k, v)}); "
            f"the Triton kernel supports head_dim in {HEAD_DIMS}, the same for q, k and v{hint}"
        )
    if q.dtype not in DTYPES:
        raise ValueError(
            f"attention: dtype {q.dtype}; the Triton kernel supports "
            f"{', '.join(str(d) for d in DTYPES)}{hint}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"attention: seq of q {q.shape[2]} != seq of k/v {k.shape[2]} ({_shapes(q, k, v)}); "
            f"the Triton kernel needs equal lengths{hint}"
        )
    if not q.is_cuda and not INTERPRET:
        raise ValueError(
            f"attention: PIPEC_ATTENTION=triton with tensors on {q.device}; the Triton kernel "
            "needs CUDA tensors, or TRITON_INTERPRET=1 set before runtime.kernels is imported "
            "to interpret it on the CPU"
        )


def _backend(q: torch.Tensor) -> str:
    """PIPEC_ATTENTION if set, else Triton for CUDA tensors and SDPA elsewhere."""
    forced = os.environ.get("PIPEC_ATTENTION", "")
    if forced and forced not in BACKENDS:
        raise ValueError(
            f"PIPEC_ATTENTION={forced!r}; expected one of {BACKENDS}, or unset "
            "(Triton on CUDA tensors, SDPA elsewhere)"
        )
    return forced or ("triton" if q.is_cuda else "sdpa")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)` for inputs of
    shape (batch, heads, seq, head_dim), where k and v may have fewer heads than q (grouped-query
    attention: q head h uses kv head h // (q heads / kv heads)).

    Runs the Triton kernel on CUDA tensors and SDPA elsewhere; PIPEC_ATTENTION=triton|sdpa forces
    one. The kernel supports head_dim 32/64/128, fp16/bf16/fp32 and seq_q == seq_k; other inputs
    raise ValueError before anything is launched.
    """
    _check_inputs(q, k, v)
    if _backend(q) == "sdpa":
        gqa = k.shape[1] != q.shape[1]
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa
        )
    _check_kernel_inputs(q, k, v)
    scale = q.shape[3] ** -0.5 if scale is None else scale
    return _FlashAttention.apply(q, k, v, is_causal, scale)
