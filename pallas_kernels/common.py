"""Shared pieces of the Pallas kernels: MMA operands, packed list entries, tile ranges.

Every kernel in this package is a Pallas **Triton** kernel
(``jax.experimental.pallas.triton.CompilerParams``): the DoSA stages need
forward ``cumsum`` (survivor compaction), masked stores at computed positions
and gathers by integer arrays (refinement), which Triton lowers and Mosaic GPU
does not (DESIGN §13). Compiled for sm_90, Triton's tiles reach the Hopper
tensor cores (``wgmma`` with ``cp.async``-pipelined key loads). On a machine
without a GPU the same kernels run with ``interpret=True`` (CI); whether a GPU
is present is decided in one place, :func:`dosa_jax.backend.on_gpu`.

MMA operands (``mma_pieces``): the tensor cores multiply bf16 tiles with
float32 accumulation. float8_e4m3fn and bfloat16 values are exact in bf16, so
they are fed as one piece; float32/float16 values are split into two bf16
pieces ``x ≈ hi + lo`` (``|x − hi − lo| ≤ 2^-16 |x|``) and a dot becomes
``hi·hi + hi·lo + lo·hi`` (three MMAs, fixed order). The representation error
is part of the kernels' error coefficient (:mod:`pallas_kernels.numerics`).

FP8 operands are widened to bf16 *once, before the kernels* (``widen_fp8``,
the default; exact, so the scores are the same): an fp8 key tile cannot be an
MMA operand of a bf16 ``wgmma`` as it is, and converting it inside the kernel
puts a register pass (narrow shared-memory loads and unpacks) on the critical
path of every key tile; widened bf16 tiles are fed to ``wgmma`` straight from
shared memory. The price is a bf16 copy of the keys (2 bytes per element
instead of 1). The decode kernels read FP8 keys as stored and widen them in
registers; the decode screen multiplies them in float16 against query rows
scaled by powers of two (``scaled_f16_pieces``): e4m3 → float16 is one
conversion per two elements on sm_90, e4m3 → bf16 four.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dosa_jax.backend import on_gpu
from dosa_jax.numerics import norm_upper, rounded_to
from dosa_jax.selection import INT32_MIN

Array = jax.Array

#: Order key meaning "accept every eligible score" (one above the NaN key).
THETA_NONE = int(INT32_MIN) + 1
#: Queries per refinement group (bits of a survivor record's mask).
GROUP = 4
#: Bits of a survivor id; the bits above carry the per-query survival mask.
ID_BITS = 27
ID_MASK = (1 << ID_BITS) - 1
MAX_KEYS = 1 << ID_BITS

BF16 = jnp.dtype(jnp.bfloat16)
F16 = jnp.dtype(jnp.float16)
FP8 = jnp.dtype(jnp.float8_e4m3fn)
#: The float16 rows of :func:`scaled_f16_pieces` have their largest magnitude in
#: [2^(F16_TOP-1), 2^F16_TOP): below float16's largest finite value (65504), and far enough
#: above its subnormals (2^-14) that a bf16 row keeps every element ≥ 2^-31·max exact.
F16_TOP = 15
#: Bounds of the row exponents of :func:`scaled_f16_pieces` (rows with larger or smaller
#: magnitudes lose bits, which the representation error charges).
F16_EXPONENT_LIMIT = 64


def interpret_default() -> bool:
    """Run kernels in interpret mode unless the default device is a GPU."""
    return not on_gpu()


def compiler_params(num_warps: int = 4, num_stages: int = 2):
    """Triton compiler parameters (selects the Triton backend in jax >= 0.11)."""
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a, b):
    return (a + b - 1) // b


def mma_pieces(x: Array, mma_dtype=BF16, widen_fp8: bool = True) -> Array:
    """Stack of MMA operand pieces [P, ...] whose sum represents ``x``.

    bf16/fp8 inputs (and fp8 inputs when ``mma_dtype`` is fp8): one exact piece; an fp8
    piece for a bf16 MMA is widened to bf16 here (``widen_fp8``) or kept as fp8 and
    converted inside the kernel (half the bytes read, but a slow register path on sm_90).
    float32/float16: hi = bf16(x), lo = bf16(x − hi).
    """
    mma_dtype = jnp.dtype(mma_dtype)
    dt = jnp.dtype(x.dtype)
    if mma_dtype == FP8:
        if dt != FP8:
            raise TypeError(f"mma_dtype=float8_e4m3fn needs float8_e4m3fn operands, got {dt}")
        return x[None]
    if dt == BF16:
        return x[None]
    if dt == FP8:
        return (x.astype(BF16) if widen_fp8 else x)[None]   # exact in bf16
    xf = x.astype(jnp.float32)
    hi = rounded_to(xf, BF16)     # (a bare f32 -> bf16 -> f32 round trip may be dropped under jit)
    return jnp.stack([hi.astype(BF16), (xf - hi).astype(BF16)])


def scaled_f16_pieces(x: Array, weights=None):
    """float16 MMA pieces of rows ``x`` [..., D], each row scaled by a power of two.

    Row r is multiplied by 2^e_r (exact) so that its largest magnitude lies in
    [2^(F16_TOP−1), 2^F16_TOP) (e_r = 0 for zero or non-finite rows; |e_r| ≤
    :data:`F16_EXPONENT_LIMIT`), then split: one float16 piece for bf16, float16 and fp8
    rows (exact for every element ≥ 2^-31·max|row|), hi + lo for float32 rows (the
    remainder ≤ 2^-22 relative). Products of float16 pieces with FP8 (or float16) keys are
    exact in float32 and their sums never subnormal (every product is a multiple of 2^-33),
    so a float16 MMA of scaled rows rounds like a bf16 MMA of the rows, times 2^e_r.

    ``weights`` [...] (float32, the rows' head weights): a row whose weight times 2^-e_r
    would not be exact (it underflows or overflows) keeps e_r = 0, so that the scorer's
    weights w·2^-e are exactly the weights scaled.

    Returns (pieces [P, ..., D] float16, e [...] int32); :func:`scaled_f16_error` bounds
    ‖x − Σ pieces·2^-e‖.
    """
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    _, top = jnp.frexp(amax)                       # amax < 2^top
    ok = (amax > 0) & jnp.isfinite(amax)
    e = jnp.where(ok, jnp.clip(F16_TOP - top, -F16_EXPONENT_LIMIT, F16_EXPONENT_LIMIT), 0)
    e = e.astype(jnp.int32)
    if weights is not None:
        wf = weights.astype(jnp.float32)
        back = jnp.ldexp(jnp.ldexp(wf, -e), e)
        e = jnp.where((back == wf) | ~jnp.isfinite(wf), e, 0)
    xs = jnp.ldexp(xf, e[..., None])
    hi = xs.astype(F16)
    if jnp.dtype(x.dtype) in (BF16, F16, FP8):
        return hi[None], e
    lo = (xs - hi.astype(jnp.float32)).astype(F16)
    return jnp.stack([hi, lo]), e


def scaled_f16_error(x: Array, pieces: Array, e: Array) -> Array:
    """‖x − Σ pieces·2^-e‖ along the last axis, bounded upward (float32; the rows' scaling
    is exact except where it underflows, at most 2^-150 per element, which is added)."""
    xs = jnp.ldexp(x.astype(jnp.float32), e[..., None])
    pieces = lax.optimization_barrier(pieces)
    d = xs
    for p in range(pieces.shape[0]):            # each subtraction exact (Sterbenz-like)
        d = d - pieces[p].astype(jnp.float32)
    allowance = jnp.float32(np.sqrt(x.shape[-1]) * 2.0 ** -149)
    up = norm_upper(d) * jnp.float32(1 + 2.0 ** -20) + allowance
    return jnp.ldexp(up, -e) + jnp.float32(2.0 ** -126)   # the floor: ldexp may underflow


def row_pieces(x: Array, single: bool) -> Array:
    """MMA pieces of screening rows: one bf16 piece (``single``; the rounding, zero for rows
    exact in bf16, is charged by :func:`pallas_kernels.numerics.representation_error`), else
    hi + lo as :func:`mma_pieces`."""
    return x.astype(BF16)[None] if single else mma_pieces(x.astype(jnp.float32))


def mma_dtype_of(a, b, fp8_mma: bool = False):
    """The MMA operand dtype of a product of stored pieces ``a`` and ``b``: fp8 (``fp8_mma``),
    float16 when either piece is float16 (:func:`scaled_f16_pieces` rows against FP8 keys,
    widened to float16 in registers: one conversion per two elements on sm_90), else bf16."""
    if fp8_mma:
        return FP8
    return F16 if F16 in (jnp.dtype(a.dtype), jnp.dtype(b.dtype)) else BF16


def as_mma_operand(x, fp8_mma: bool = False, dtype=None):
    """In-kernel cast of a stored piece to the MMA operand dtype ``dtype`` (default: fp8 with
    ``fp8_mma``, else bf16); exact for fp8 -> bf16 and fp8 -> float16."""
    want = jnp.dtype(dtype) if dtype is not None else (FP8 if fp8_mma else BF16)
    return x if jnp.dtype(x.dtype) == want else x.astype(want)


def keys_rows_dot(k_pieces, q_pieces, pairs, fp8_mma: bool = False):
    """Σ over the piece pairs (q piece a, k piece b) of k_b · q_aᵀ, inside a kernel:
    [BK, D] × [n, D] -> [BK, n] float32, keys as MMA rows (the ``"kh"``/``"kc"`` layouts)."""
    x = None
    for a, b in pairs:
        dt = mma_dtype_of(k_pieces[b], q_pieces[a], fp8_mma)
        d = lax.dot_general(as_mma_operand(k_pieces[b], dtype=dt),
                            as_mma_operand(q_pieces[a], dtype=dt),
                            (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        x = d if x is None else x + d
    return x


def rows_keys_dot(q_pieces, k_pieces, pairs, fp8_mma: bool = False):
    """Σ over the piece pairs of q_a · k_bᵀ, inside a kernel: [n, D] × [BK, D] -> [n, BK]
    float32, query rows as MMA rows (the ``"hk"`` layout)."""
    x = None
    for a, b in pairs:
        dt = mma_dtype_of(q_pieces[a], k_pieces[b], fp8_mma)
        d = jnp.dot(as_mma_operand(q_pieces[a], dtype=dt), as_mma_operand(k_pieces[b], dtype=dt).T,
                    preferred_element_type=jnp.float32)
        x = d if x is None else x + d
    return x


def unpack_entries(e, valid):
    """(valid, key id, query mask) of packed list entries ``id | mask << ID_BITS`` (−1: none);
    ids and masks are 0 on invalid lanes, so gathers by the ids stay in bounds."""
    valid = valid & (e >= 0)
    return valid, jnp.where(valid, e & ID_MASK, 0), jnp.where(valid, e >> ID_BITS, 0)


def piece_pairs(n_left: int, n_right: int):
    """(left piece, right piece) products summed by a split dot, in a fixed order."""
    pairs = [(0, 0)]
    if n_right > 1:
        pairs.append((0, 1))
    if n_left > 1:
        pairs.append((1, 0))
    return tuple(pairs)


def pieces_value(pieces: Array) -> Array:
    """float32 value represented by MMA pieces (the kernels' operand).

    Through an optimization barrier: pieces made by a cast from float32 in the same jitted
    program would otherwise let XLA drop the round trip (``dosa_jax.numerics.rounded_to``).
    """
    pieces = lax.optimization_barrier(pieces)
    v = pieces[0].astype(jnp.float32)
    for p in range(1, pieces.shape[0]):
        v = v + pieces[p].astype(jnp.float32)
    return v


def pad_axis(x: Array, axis: int, size: int, value=0):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


# ---- in-kernel helpers (pure jnp on values; lower in Triton and interpret mode) ----

def kernel_order_key(s: Array) -> Array:
    """Monotone int32 key of float32 scores inside a kernel (NaN -> INT32_MIN).

    Same map as :func:`dosa_jax.selection.order_key`; -0.0 is expected to be
    canonicalised before (``s == 0 -> +0``).
    """
    bits = lax.bitcast_convert_type(s, jnp.int32)
    key = jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))
    return jnp.where(s != s, jnp.int32(INT32_MIN), key)


def group_range(lo, hi):
    """Union [klo, khi) of the non-empty ranges of a program's queries, inside a kernel
    (klo = 2^31 − 1, khi = 0 when all are empty: no tiles)."""
    nonempty = hi > lo
    klo = jnp.min(jnp.where(nonempty, lo, jnp.int32(2 ** 31 - 1)))
    khi = jnp.max(jnp.where(nonempty, hi, 0))
    return klo, khi


def group_ranges(lo4, hi4):
    """Outside a kernel, over each group's non-empty ranges ([G4, 4] lo/hi): (non-empty
    [G4, 4], min lo, max hi, min hi [G4]); a group with no visible key gets min lo 2^31 − 1,
    max hi 0 (as :func:`group_range`)."""
    ne = hi4 > lo4
    big = 2 ** 31 - 1
    return (ne, jnp.min(jnp.where(ne, lo4, big), axis=1), jnp.max(jnp.where(ne, hi4, 0), axis=1),
            jnp.min(jnp.where(ne, hi4, big), axis=1))


def split_key_tiles(klo, khi, BK: int, S: int, s):
    """Key tiles [start, stop) of split ``s`` of ``S`` covering keys [klo, khi) in tiles of BK."""
    tile0 = klo // BK
    ntile = jnp.maximum((khi + BK - 1) // BK - tile0, 0)
    per = (ntile + S - 1) // S
    start = tile0 + s * per
    return start, jnp.minimum(start + per, tile0 + ntile)


# ---- column order of "kc" tiles (keys as MMA rows, the queries' columns side by side) ----

def lane_aligned_order(BQ: int, n: int) -> np.ndarray:
    """Column order of a ``"kc"`` tile of BQ queries × n columns for in-thread column sums.

    A Hopper ``wgmma`` accumulator gives thread t of a warp the columns
    ``8j + 2(t mod 4) + {0, 1}`` of its rows. ``order[c]`` is the logical column
    ``query·n + i`` placed at MMA column ``c = ((h·n/2 + m)·4 + p)·2 + b``: query
    ``4h + p`` is fixed by c's bits 1–2 (the thread's place in its quad) and h, its
    column ``i = 2m + b`` by bit 0 and m, which one thread holds. A query's column sum is
    then additions in one thread (:func:`column_sums`), with no shuffle across lanes.
    """
    if BQ % GROUP or n < 2 or n % 2:
        raise ValueError(f"lane-aligned columns need BQ % 4 == 0 and an even n >= 2, got {BQ}, {n}")
    G, M = BQ // GROUP, n // 2
    h, m, p, b = np.meshgrid(np.arange(G), np.arange(M), np.arange(GROUP), np.arange(2),
                             indexing="ij")
    return ((4 * h + p) * n + 2 * m + b).reshape(-1)


def lane_sums_apply(BQ: int, n: int) -> bool:
    """Whether a tile of BQ queries × n columns can take :func:`lane_aligned_order`."""
    return BQ % GROUP == 0 and n >= 2 and n % 2 == 0


def in_lane_order(x: Array, BQ: int, n: int) -> Array:
    """[P, T·n, ...] stacked per-query columns (T a multiple of BQ) in
    :func:`lane_aligned_order` within each tile of BQ queries."""
    order = lane_aligned_order(BQ, n)
    P, Tn = x.shape[:2]
    y = x.reshape((P, Tn // (BQ * n), BQ * n) + x.shape[2:])[:, :, order]
    return y.reshape(x.shape)


def column_sums(v: Array, BQ: int, n: int, lane_sums: bool) -> Array:
    """Per (key, query) sums of a ``"kc"`` tile's columns inside a kernel:
    [BK, BQ·n] -> [BK, BQ/4, 4] (queries in groups of 4), in :func:`lane_aligned_order`
    (``lane_sums``: over b, then m, all in-thread) or query-major order."""
    bk = v.shape[0]
    G = BQ // GROUP
    if lane_sums:
        v = jnp.sum(v.reshape(bk, G, n // 2, GROUP, 2), axis=4)
        return jnp.sum(v, axis=2)
    return jnp.sum(v.reshape(bk, G, GROUP, n), axis=3)
