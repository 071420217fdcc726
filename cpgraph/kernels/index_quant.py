"""Triton providers of the FP8 indexer's operand preparation: Hadamard, index-K and query quantisation.

With FP8 KV the indexer runs ``hadamard`` and ``index_k_quant`` on k, and
``indexer_q_prepare`` (``indexer_q_quant(hadamard(q))`` in one op) on q
(``cpgraph/models/indexer.py``).  The
references are chains of small torch kernels inside custom ops (seven
butterfly ``stack``\\ s in fp32, amax / log2 / divide / clamp / cast), which
Inductor cannot fuse: at V3.2's 32K-token shape (q ``[32768, 64, 128]``)
they cost about 20 ms per layer on an H200, for under a gigabyte of bytes
that must move.  Each provider here is one pass: read the row once, write
its outputs once.

Bit-exact with the references, by construction (docs/bitwise.md):

* ``hadamard``: the Sylvester butterflies in the reference's order, in fp32
  (``a + b`` / ``a - b`` on the same operands, so every rounding and every
  signed zero matches), then the same fp32 multiply by ``D ** -0.5`` and the
  same round-to-nearest-even cast back (``_bits``).  A ``tl.dot`` against
  the Hadamard matrix would sum in another order and differ in last bits.
  Each stage pairs the lowest index bit of the register tile (``split`` of a
  trailing 2-axis, ``join`` of ``a + b``, ``a - b``) and then rotates the
  index bits right by one (a transpose of the last two axes), so after
  ``log2 D`` stages every bit was paired once, in the reference's order
  (bit 0 first), and the tile is back in natural order.  No reduction is
  used: reductions may start from ``+0`` and lose a ``-0``.
* ``index_k_quant``: the codec's own tile quantiser
  (:func:`cpgraph.kernels.codecs._quantize_tile`, shared with
  ``index_k_store``), so the bytes and scales are the ones the pages hold.
* ``indexer_q_quant``: the row's amax is an integer max over magnitude bits
  (exact; NaN patterns order above ``inf``), the power-of-two scale comes
  from the amax's bits (``_bits.pow2_exponent``, equal to
  ``ue8m0_scale``), quantisation multiplies by the exact inverse power of
  two, the cast is c10's round-to-nearest-even (``_bits.e4m3_bits``) and
  the folded weight is the same fp32 product.  Non-finite rows follow the
  reference: a NaN makes the scale NaN (every byte a NaN code, the folded
  weight NaN); an infinity without NaN makes the scale ``inf`` (finite values
  become ``+-0``, infinities NaN codes).  NaN codes are always ``0x7F``; the
  reference's NaN byte takes the sign of whatever NaN its division produced,
  which differs between CPU and CUDA, so tests compare NaN codes as one value.

``indexer_q_prepare`` runs the same butterflies, rounds to the activation
dtype as ``hadamard`` stores it, and quantises with the same code, so its
bytes are the pair's: q's rotated rows are neither written nor read back.

A row's result depends on that row only (tiles are whole rows); grids come
from shapes, nothing is read back on the host (CUDA-graph capturable);
every load and store is masked by the row count and the row width; row
offsets are int64.  Inputs a kernel does not take fall back to the
reference through the ledger: a last dim above :data:`MAX_D` (one row per
program must fit the registers).  Every dtype the ops accept (fp32, bf16,
fp16) is taken; bf16 travels as its int16 bits (the interpreter has no
bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpgraph.ops import ledger

from ._bits import KINDS, bits_view, e4m3_bits, load_f32, pow2_exponent, round_to_kind, store_f32_as
from ._launch import Launcher, interpreting
from .codecs import _quantize_tile
from .provider_name import PROVIDER_NAME

REFERENCE = "reference"
MAX_D = 4096  # widest row a program takes whole (values kept in registers)

# Values per program and warps on the GPU, per op (benchmarks/index_quant_bench.py --sweep).
TILES = {"hadamard": (4096, 4), "index_k_quant": (4096, 4), "indexer_q_quant": (4096, 4)}


def _tile(op: str, row_values: int, n: int, tile) -> tuple[int, int]:
    """(rows per program, warps): a power of two of whole rows, about ``values`` values per program."""
    values, warps = tile or TILES[op]
    if interpreting():
        values = 1 << 18  # the interpreter's cost is per program
    rows = max(1, min(triton.next_power_of_2(max(n, 1)), values // row_values))
    return rows, warps


def _too_wide(op: str, x: torch.Tensor, d: int) -> bool:
    if d <= MAX_D:
        return False
    ledger.fell_back(op, x.device.type, REFERENCE, f"last dim above {MAX_D} (a program holds whole rows)",
                     instead_of=PROVIDER_NAME)  # fmt: skip
    return True


# --------------------------------------------------------------------- hadamard
@triton.jit
def _butterflies(y, ROWS: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr):
    """The unscaled Sylvester transform of each row of ``y`` ``[ROWS, D]`` (fp32), in the reference's order."""
    for _ in tl.static_range(LOG2D):
        # Pair the lowest bit of the tile's index (a = bit 0, b = bit 1), as the reference's stage does,
        # then rotate the index bits right by one: the next stage pairs the next bit.
        a, b = tl.split(tl.reshape(y, (ROWS, D // 2, 2)))
        y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (ROWS, D))
    return y


@triton.jit
def _hadamard_kernel(x, out, n, x_stride, scale, KIND: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr,
                     ROWS: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < n
    r = rows.to(tl.int64)
    cols = tl.arange(0, D)
    y = _butterflies(load_f32(x + r[:, None] * x_stride + cols[None, :], ok[:, None], KIND), ROWS, D, LOG2D)
    store_f32_as(out + r[:, None] * D + cols[None, :], y * scale, ok[:, None], KIND)


def hadamard(x: torch.Tensor, tile=None) -> torch.Tensor:
    """Provider of ``cpgraph::hadamard``: contiguous ``x.dtype`` output like the reference (``tile``: benchmark)."""
    d = x.shape[-1]
    if _too_wide("hadamard", x, d):
        from cpgraph.ops.indexer import hadamard_reference

        return hadamard_reference(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x.numel() // d
    if n == 0:
        return out
    x2 = x.reshape(n, d)
    if d > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    rows, warps = _tile("hadamard", d, n, tile)
    _HADAMARD(
        (triton.cdiv(n, rows),),
        [bits_view(x2), bits_view(out), n, x2.stride(0) if n > 1 else d, d**-0.5, KINDS[x.dtype], d,
         d.bit_length() - 1, rows],
        warps,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------- index_k_quant
@triton.jit
def _index_k_quant_kernel(keys, out8, scale_bits, n, key_stride, KIND: tl.constexpr, D: tl.constexpr,
                          NB: tl.constexpr, NBP: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < n
    r = rows.to(tl.int64)
    cols = tl.arange(0, NBP * 128)
    inside = ok[:, None] & (cols < D)[None, :]
    x = load_f32(keys + r[:, None] * key_stride + cols[None, :], inside, KIND)  # padding 0: amax unchanged
    q, e = _quantize_tile(x, ROWS, NBP)
    tl.store(out8 + r[:, None] * D + cols[None, :], q.to(tl.uint8), mask=inside)
    blocks = tl.arange(0, NBP)
    tl.store(scale_bits + r[:, None] * NB + blocks[None, :], (e + 127) << 23, mask=ok[:, None] & (blocks < NB)[None, :])


def index_k_quant(keys: torch.Tensor, tile=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Provider of ``cpgraph::index_k_quant``: ``(uint8 [N, D], f32 [N, ceil(D / 128)])`` in one pass."""
    n, d = keys.shape
    if _too_wide("index_k_quant", keys, d):
        from cpgraph.ops.codecs import index_k_quant_reference

        return index_k_quant_reference(keys)
    nb = (d + 127) // 128
    out = torch.empty((n, d), dtype=torch.uint8, device=keys.device)
    scales = torch.empty((n, nb), dtype=torch.float32, device=keys.device)
    if n == 0 or d == 0:
        return out, scales
    k = keys if d == 1 or keys.stride(1) == 1 else keys.contiguous()
    nbp = triton.next_power_of_2(nb)
    rows, warps = _tile("index_k_quant", nbp * 128, n, tile)
    _INDEX_K_QUANT(
        (triton.cdiv(n, rows),),
        [bits_view(k), out, scales.view(torch.int32), n, k.stride(0) if n > 1 else d, KINDS[keys.dtype], d, nb,
         nbp, rows],
        warps,
    )  # fmt: skip
    return out, scales


# -------------------------------------------------------------- indexer_q_quant
@triton.jit
def _indexer_q_quant_kernel(q, w, out8, w_out, n, H, q_s0, q_s1, w_s0, w_s1, KIND: tl.constexpr, D: tl.constexpr,
                            DP: tl.constexpr, ROWS: tl.constexpr, HW_CAST: tl.constexpr):  # fmt: skip
    """Row ``r = m * H + h`` of ``q [M, H, D]`` (unit last stride) -> e4m3 bytes and ``w[m, h] * scale``."""
    x, r, m, h, ok, inside, cols = _load_q_rows(q, n, H, q_s0, q_s1, KIND, D, DP, ROWS)
    _quantize_q_rows(x, w, out8, w_out, r, m, h, ok, inside, cols, w_s0, w_s1, D, HW_CAST)


@triton.jit
def _load_q_rows(q, n, H, q_s0, q_s1, KIND: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, ROWS: tl.constexpr):
    """This program's rows ``r = m * H + h`` of ``q [M, H, D]`` in fp32 (padding 0), with their indices and masks."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < n
    r = rows.to(tl.int64)
    m = r // H
    h = r - m * H
    cols = tl.arange(0, DP)
    inside = ok[:, None] & (cols < D)[None, :]
    x = load_f32(q + (m * q_s0 + h * q_s1)[:, None] + cols[None, :], inside, KIND)
    return x, r, m, h, ok, inside, cols


@triton.jit
def _quantize_q_rows(x, w, out8, w_out, r, m, h, ok, inside, cols, w_s0, w_s1, D: tl.constexpr,
                     HW_CAST: tl.constexpr):  # fmt: skip
    """Rows ``r`` (``x`` fp32, padding 0): e4m3 bytes into ``out8``, ``w[m, h] * scale`` into ``w_out``.

    ``HW_CAST`` (the GPU): the e4m3 code from the hardware's saturating conversion (``cvt.rn.satfinite``:
    round to nearest even, finite values past 448 to 448, what the clamp and :func:`e4m3_bits` compute) in
    half an instruction a value instead of about fifteen; NaN still becomes 0x7F by the ``where``."""
    amax_bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)  # exact; NaN bits > inf bits
    finite = amax_bits < 0x7F800000
    infinite = amax_bits == 0x7F800000
    e = pow2_exponent(tl.where(finite, amax_bits, 0).to(tl.float32, bitcast=True))
    # Non-finite amax: the reference's scale is that amax itself (inf, or NaN); 1 / scale is 0 or NaN.
    scale = tl.where(finite, (e + 127) << 23, tl.where(infinite, 0x7F800000, 0x7FC00000)).to(tl.float32, bitcast=True)
    inv = tl.where(finite, (127 - e) << 23, tl.where(infinite, 0, 0x7FC00000)).to(tl.float32, bitcast=True)
    y = x * inv[:, None]  # == x / scale (a power of two, or inf / NaN with IEEE's x / inf, x / NaN)
    nan = (y.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000
    if HW_CAST:
        code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        code = e4m3_bits(tl.minimum(tl.maximum(y, -448.0), 448.0))
    bits = tl.where(nan, 0x7F, code)
    tl.store(out8 + r[:, None] * D + cols[None, :], bits.to(tl.uint8), mask=inside)
    wv = tl.load(w + m * w_s0 + h * w_s1, mask=ok, other=0.0)
    tl.store(w_out + r, wv * scale, mask=ok)


def _q_rows(launcher, q: torch.Tensor, weights: torch.Tensor, tile, before_kind: list, constexprs: list):
    """Launch a query-row kernel (``q, w, out8, w_out, n, H`` and the strides, ``before_kind``, then ``KIND`` and
    ``constexprs``) over ``q [M, H, D]``; returns ``(uint8 [M, H, D], f32 [M, H])``, contiguous."""
    m, h, d = q.shape
    out = torch.empty((m, h, d), dtype=torch.uint8, device=q.device)
    w_out = torch.empty((m, h), dtype=torch.float32, device=q.device)
    n = m * h
    if n == 0:
        return out, w_out
    qq = q if d == 1 or q.stride(2) == 1 else q.contiguous()  # rows may be strided, values not
    rows, warps = _tile("indexer_q_quant", triton.next_power_of_2(d), n, tile)
    launcher(
        (triton.cdiv(n, rows),),
        [bits_view(qq), weights, out, w_out, n, h, qq.stride(0), qq.stride(1), weights.stride(0), weights.stride(1),
         *before_kind, KINDS[q.dtype], *constexprs, rows, q.is_cuda and not interpreting()],
        warps,
    )  # fmt: skip
    return out, w_out


def indexer_q_quant(q: torch.Tensor, weights: torch.Tensor, tile=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Provider of ``cpgraph::indexer_q_quant``: ``(uint8 [M, H, D], f32 [M, H])``, contiguous, in one pass."""
    d = q.shape[2]
    if d == 0:  # no amax to take: the reference raises, so does this
        from cpgraph.ops.indexer import indexer_q_quant_reference

        return indexer_q_quant_reference(q, weights)
    return _q_rows(_Q_QUANT, q, weights, tile, [], [d, triton.next_power_of_2(d)])


# ------------------------------------------------------------ indexer_q_prepare
@triton.jit
def _indexer_q_prepare_kernel(q, w, out8, w_out, n, H, q_s0, q_s1, w_s0, w_s1, scale, KIND: tl.constexpr,
                              D: tl.constexpr, LOG2D: tl.constexpr, ROWS: tl.constexpr,
                              HW_CAST: tl.constexpr):  # fmt: skip
    """Rows of ``q [M, H, D]`` (``D`` a power of two): rotated, rounded to ``KIND``, then quantised as above.

    On the GPU the bf16 rounding is the hardware's (one conversion instead of about eight integer
    instructions a value; the same value, and a NaN's payload is never stored: its row's codes are 0x7F)."""
    x, r, m, h, ok, inside, cols = _load_q_rows(q, n, H, q_s0, q_s1, KIND, D, D, ROWS)
    x = _butterflies(x, ROWS, D, LOG2D) * scale
    if HW_CAST and KIND == 1:
        x = x.to(tl.bfloat16).to(tl.float32)
    else:
        x = round_to_kind(x, KIND)  # what hadamard stores and the quantiser reads
    _quantize_q_rows(x, w, out8, w_out, r, m, h, ok, inside, cols, w_s0, w_s1, D, HW_CAST)


def indexer_q_prepare(q: torch.Tensor, weights: torch.Tensor, tile=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Provider of ``cpgraph::indexer_q_prepare``: the rotation and the quantisation in one pass over ``q``
    (the op guarantees a power-of-two ``D <= 128``: one program row holds a whole row)."""
    d = q.shape[2]
    return _q_rows(_Q_PREPARE, q, weights, tile, [d**-0.5], [d, d.bit_length() - 1])


_HADAMARD = Launcher(_hadamard_kernel)
_INDEX_K_QUANT = Launcher(_index_k_quant_kernel)
_Q_QUANT = Launcher(_indexer_q_quant_kernel)
_Q_PREPARE = Launcher(_indexer_q_prepare_kernel)


__all__ = ["MAX_D", "TILES", "hadamard", "index_k_quant", "indexer_q_quant", "indexer_q_prepare"]
