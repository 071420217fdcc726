"""Triton codecs: MLA FP8 656-byte records and fp8 index-K pages (bit-exact).

Layouts and the scale rule are defined in :mod:`cpgraph.ops.codecs`; the
number conversions are the integer-exact ones of :mod:`._bits`.  Each
program handles a tile of tokens; one token's bytes are produced in one
pass (read the floats once, write the record once), which is the whole
point compared with the reference's separate amax / divide / cast / cat
kernels.

The output buffer is addressed through several dtype views of the same
memory (uint8 for e4m3 bytes, int16 for bf16 RoPE bits, int32 for scales)
so every field is written with its natural width.

Memory safety: the launchers check every shape the kernels hard-code (512 /
64 / 656 / page widths) on the host, row offsets are int64, and
``index_k_store`` masks every write by the slot range ``[0, pages *
page_size)``, so a slot outside it is skipped like ``-1``.  Non-finite
input follows the rule of :mod:`cpgraph.ops.codecs` (scale from finite
values, ``+-inf`` -> ``+-448``, NaN -> ``0x7F``; RoPE NaN -> ``0x7FC0``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._bits import (
    KIND_BF16, KINDS, bf16_bits, e4m3_bits, e4m3_to_f32_fast, exp2_f32, load_f32, pow2_exponent, store_f32_as,
)  # fmt: skip
from ._launch import Launcher
from .move import interpreting


def _operand(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Row-contiguous operand and its kind (bf16 is passed as its int16 bits)."""
    if t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
        t = t.contiguous()
    kind = KINDS[t.dtype]
    return (t.view(torch.int16) if kind == KIND_BF16 else t), kind


def _row_stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def _rows_per_program(per_row_values: int, n: int) -> int:
    target = (1 << 18) if interpreting() else 4096
    return max(1, min(triton.next_power_of_2(max(n, 1)), target // per_row_values, 1024))


# -------------------------------------------------------------- quantise
@triton.jit
def _quantize_tile(x, ROWS: tl.constexpr, NB: tl.constexpr):
    """``x [ROWS, NB*128]`` fp32 -> (e4m3 bytes int32 ``[ROWS, NB*128]``, exponents int32 ``[ROWS, NB]``).

    Non-finite values are classified from their bits (no reliance on how a
    back end's max/min treat NaN): the amax skips them, ``+-inf`` clamps to
    ``+-448`` and every NaN becomes ``0x7F``.
    """
    xb = tl.reshape(x, (ROWS, NB, 128))
    mag = xb.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    e = pow2_exponent(tl.max(tl.where(mag < 0x7F800000, tl.abs(xb), 0.0), axis=2))
    q = xb * exp2_f32(-e)[:, :, None]  # == x / 2**e exactly (power of two)
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    bits = tl.where(mag > 0x7F800000, 0x7F, e4m3_bits(q))
    return tl.reshape(bits, (ROWS, NB * 128)), e


# ----------------------------------------------------------- MLA records
@triton.jit
def _mla_fp8_pack_kernel(
    latent, k_pe, out8, out16, out32, n, lat_stride, pe_stride,
    LAT_KIND: tl.constexpr, PE_KIND: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < n
    r = rows.to(tl.int64)
    cols = tl.arange(0, 512)
    x = load_f32(latent + r[:, None] * lat_stride + cols[None, :], ok[:, None], LAT_KIND)
    q, e = _quantize_tile(x, ROWS, 4)
    tl.store(out8 + r[:, None] * 656 + cols[None, :], q.to(tl.uint8), mask=ok[:, None])
    sc = tl.arange(0, 4)
    tl.store(out32 + r[:, None] * 164 + 128 + sc[None, :], (e + 127) << 23, mask=ok[:, None])
    pc = tl.arange(0, 64)
    pe_ptrs = k_pe + r[:, None] * pe_stride + pc[None, :]
    if PE_KIND == 1:  # bf16 in: copied bit for bit
        pe = tl.load(pe_ptrs, mask=ok[:, None], other=0)
    else:  # rounded to nearest even, every NaN -> 0x7FC0
        pe = bf16_bits(load_f32(pe_ptrs, ok[:, None], PE_KIND))
    tl.store(out16 + r[:, None] * 328 + 264 + pc[None, :], pe, mask=ok[:, None])


def _require(ok: bool, op: str, what: str) -> None:
    if not ok:
        raise ValueError(f"cpgraph.{op} (triton): {what}")


def mla_fp8_pack(latent: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """Provider of ``cpgraph::mla_fp8_pack``: ``uint8 [N, 656]`` in one pass."""
    n = latent.shape[0]
    _require(latent.dim() == 2 and latent.shape[1] == 512, "mla_fp8_pack",
             f"latent must be [N, 512], not {tuple(latent.shape)}")  # fmt: skip
    _require(tuple(k_pe.shape) == (n, 64), "mla_fp8_pack", f"k_pe must be [{n}, 64], not {tuple(k_pe.shape)}")
    out = torch.empty((n, 656), dtype=torch.uint8, device=latent.device)
    if n == 0:
        return out
    lat, lat_kind = _operand(latent)
    pe, pe_kind = _operand(k_pe)
    rows = _rows_per_program(512, n)
    _PACK(
        (triton.cdiv(n, rows),),
        [lat, pe, out, out.view(torch.int16), out.view(torch.int32), n, _row_stride(lat), _row_stride(pe),
         lat_kind, pe_kind, rows],
        4,
    )  # fmt: skip
    return out


@triton.jit
def _mla_fp8_unpack_kernel(rec8, rec16, rec32, out, n, OUT_KIND: tl.constexpr, ROWS: tl.constexpr):
    """One 128-value tile at a time (its scale is one word per row: no reshape, no broadcast shuffle)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < n
    r = rows.to(tl.int64)
    cols = tl.arange(0, 128)
    for b in tl.static_range(4):
        q = tl.load(rec8 + r[:, None] * 656 + b * 128 + cols[None, :], mask=ok[:, None], other=0).to(tl.int32)
        scale = tl.load(rec32 + r * 164 + 128 + b, mask=ok, other=0).to(tl.float32, bitcast=True)
        lat = e4m3_to_f32_fast(q) * scale[:, None]
        store_f32_as(out + r[:, None] * 576 + b * 128 + cols[None, :], lat, ok[:, None], OUT_KIND)
    pc = tl.arange(0, 64)
    pe = tl.load(rec16 + r[:, None] * 328 + 264 + pc[None, :], mask=ok[:, None], other=0)
    pe_ptrs = out + r[:, None] * 576 + 512 + pc[None, :]
    if OUT_KIND == 1:
        tl.store(pe_ptrs, pe, mask=ok[:, None])
    else:
        store_f32_as(pe_ptrs, (pe.to(tl.int32) << 16).to(tl.float32, bitcast=True), ok[:, None], OUT_KIND)


# Tile of the unpack: rows per program and warps (tuned on the H200, see docs/kernels.md).
UNPACK_ROWS = 8
UNPACK_WARPS = 4


def mla_fp8_unpack(records: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Provider of ``cpgraph::mla_fp8_unpack``: dense ``dtype [N, 576]`` rows."""
    n = records.shape[0]
    _require(records.dim() == 2 and records.shape[1] == 656, "mla_fp8_unpack",
             f"records must be [N, 656], got {tuple(records.shape)}")  # fmt: skip
    out = torch.empty((n, 576), dtype=dtype, device=records.device)
    if n == 0:
        return out
    rec = records.contiguous()
    kind = KINDS[dtype]
    rows = _rows_per_program(512, n) if interpreting() else max(1, min(UNPACK_ROWS, triton.next_power_of_2(n)))
    _UNPACK(
        (triton.cdiv(n, rows),),
        [rec, rec.view(torch.int16), rec.view(torch.int32), out.view(torch.int16) if kind == KIND_BF16 else out, n,
         kind, rows],
        UNPACK_WARPS if not interpreting() else 4,
    )  # fmt: skip
    return out


# ---------------------------------------------------------- index-K pages
@triton.jit
def _index_k_store_kernel(
    keys, slots, pages, n, num_slots, key_stride,
    KEY_KIND: tl.constexpr, HAS_SLOTS: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr,
    PAGE: tl.constexpr, PAGE_STRIDE: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Quantise token rows and write them into fp8 index pages (keys, then scales, per page).

    A token is written iff its slot lies in ``[0, num_slots)`` (``num_slots``
    = pages * PAGE); any other slot is skipped like ``-1`` and addressed as
    slot 0 under a false mask.
    """
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < n
    r = rows.to(tl.int64)
    if HAS_SLOTS:
        slot = tl.load(slots + rows, mask=ok, other=-1).to(tl.int64)
    else:
        slot = r
    write = ok & (slot >= 0) & (slot < num_slots)
    slot = tl.where(write, slot, 0)
    page_base = (slot // PAGE) * PAGE_STRIDE
    offset = slot % PAGE
    cols = tl.arange(0, NBP * 128)
    col_ok = cols < D
    x = load_f32(keys + r[:, None] * key_stride + cols[None, :], ok[:, None] & col_ok[None, :], KEY_KIND)
    q, e = _quantize_tile(x, ROWS, NBP)
    key_ptrs = pages + page_base[:, None] + offset[:, None] * D + cols[None, :]
    tl.store(key_ptrs, q.to(tl.uint8), mask=write[:, None] & col_ok[None, :])
    # Scales are written byte by byte (little-endian): the scale area's byte
    # offset need not be 4-aligned for every (page_size, head_dim).
    sbits = (e + 127) << 23  # [ROWS, NBP]
    shift = tl.arange(0, 4) * 8
    sbytes = tl.reshape((sbits[:, :, None] >> shift[None, None, :]) & 0xFF, (ROWS, NBP * 4))
    sc = tl.arange(0, NBP * 4)
    scale_ptrs = pages + page_base[:, None] + PAGE * D + offset[:, None] * (NB * 4) + sc[None, :]
    tl.store(scale_ptrs, sbytes.to(tl.uint8), mask=write[:, None] & (sc < NB * 4)[None, :])


def _index_k_launch(pages: torch.Tensor, keys: torch.Tensor, slots, page_size: int) -> None:
    n, d = keys.shape
    if n == 0 or pages.shape[0] == 0:
        return
    nb = (d + 127) // 128
    nbp = triton.next_power_of_2(nb)
    width = page_size * (d + 4 * nb)
    _require(pages.dim() == 2 and pages.shape[1] == width and (width <= 1 or pages.stride(1) == 1), "index_k_store",
             f"pages must be uint8 [P, {width}] with unit last stride, not {tuple(pages.shape)}")  # fmt: skip
    _require(slots is None or tuple(slots.shape) == (n,), "index_k_store", f"slots must be [{n}]")
    k, kind = _operand(keys)
    rows = _rows_per_program(nbp * 128, n)
    page_stride = pages.stride(0) if pages.shape[0] > 1 else pages.shape[1]
    _INDEX_K_STORE(
        (triton.cdiv(n, rows),),
        [k, slots if slots is not None else k, pages, n, pages.shape[0] * page_size, _row_stride(k), kind,
         slots is not None, d, nb, nbp, page_size, page_stride, rows],
        4,
    )  # fmt: skip


def index_k_page_pack(keys: torch.Tensor, page_size: int) -> torch.Tensor:
    """Provider of ``cpgraph::index_k_page_pack``: whole pages, token ``t`` -> slot ``t``."""
    n, d = keys.shape
    nb = (d + 127) // 128
    pages = torch.empty((n // page_size, page_size * (d + 4 * nb)), dtype=torch.uint8, device=keys.device)
    _index_k_launch(pages, keys, None, page_size)
    return pages


def index_k_store(pages: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, page_size: int) -> None:
    """Provider of ``cpgraph::index_k_store``: quantise and write at ``slots`` (``-1`` skipped)."""
    if pages.shape[0] == 0:
        return
    _index_k_launch(pages, keys, slots, page_size)


_PACK = Launcher(_mla_fp8_pack_kernel)
_UNPACK = Launcher(_mla_fp8_unpack_kernel)
_INDEX_K_STORE = Launcher(_index_k_store_kernel)
