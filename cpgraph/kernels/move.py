"""One Triton row mover behind every byte-moving op.

take_rows, compact_valid/restore_compute (both forms), paged_gather,
paged_store, index_k_gather and the materialisation placement all move
whole rows of bytes from one address set to another.  They differ only in
how a row number becomes an address:

* gather: ``dst row r  <-  src row index[r]`` (``-1`` -> zero row);
* scatter: ``dst row index[r]  <-  src row r`` (``-1`` -> skipped);
* an index outside ``[0, rows of the indexed buffer)`` -- below ``-1``,
  past the end, anything into an empty buffer -- is treated exactly like
  ``-1``: every load and store is masked by the index's range and the
  address of a masked row is computed from row 0, so no kernel ever
  touches memory outside its tensors, with or without ``CPGRAPH_DEBUG``
  (which only makes the ops raise on such ids beforehand).  The bound is
  one runtime integer compared per row: free next to the row's bytes;
* a row address is ``(row // PAGE) * PAGE_STRIDE + (row % PAGE) * TOK_STRIDE
  + BASE``, which covers plain rows (``PAGE == 1``) and token slices of
  fp8 index-K pages (keys and scales live in different parts of a page).

Rows are moved as the widest machine word (8/4/2/1 bytes) that divides the
row width, every stride, the base offsets and both data pointers, so a
bf16 hidden row travels as int64 words and Triton can issue 16-byte
accesses.  Widths and strides are compile-time constants: the alignment
they imply is what lets Triton vectorise (there are few distinct
geometries per model, so few compilations).  Grid sizes come from shapes
only and nothing reads device data on the host, so every launch is CUDA
graph capturable.  Offsets are int64 (row ids are widened before they are
multiplied by a stride), so ``row * stride`` past 2**31 bytes is safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import segments
from ._launch import Launcher, interpreting
from .addressing import WORD_DTYPES, Layout, byte_rows, layout_fits, layout_rows, word_size


@triton.jit
def _row_offset(row, PAGE: tl.constexpr, PAGE_STRIDE: tl.constexpr, TOK_STRIDE: tl.constexpr):
    if PAGE == 1:
        return row * PAGE_STRIDE
    else:
        return (row // PAGE) * PAGE_STRIDE + (row % PAGE) * TOK_STRIDE


@triton.jit
def _move_rows_kernel(
    src,
    dst,
    index,
    num_rows,
    bound,
    skip_lo,
    skip_hi,
    GATHER: tl.constexpr,
    SRC_PAGE: tl.constexpr,
    SRC_PAGE_STRIDE: tl.constexpr,
    SRC_TOK_STRIDE: tl.constexpr,
    SRC_BASE: tl.constexpr,
    DST_PAGE: tl.constexpr,
    DST_PAGE_STRIDE: tl.constexpr,
    DST_TOK_STRIDE: tl.constexpr,
    DST_BASE: tl.constexpr,
    WIDTH: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SKIP: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    idx = tl.load(index + rows, mask=row_ok, other=-1).to(tl.int64)
    if SKIP == 1:  # rows whose source lies in [skip_lo, skip_hi) are left untouched (written by someone else)
        row_ok = row_ok & ((idx < skip_lo) | (idx >= skip_hi))
    elif SKIP == 2:  # only those rows, read from a buffer that starts at skip_lo
        row_ok = row_ok & (idx >= skip_lo) & (idx < skip_hi)
        idx = idx - skip_lo
    valid = row_ok & (idx >= 0) & (idx < bound)  # out of range == -1: never addressed
    idx = tl.where(valid, idx, 0)
    if GATHER:
        src_row = idx
        dst_row = rows.to(tl.int64)
    else:
        src_row = rows.to(tl.int64)
        dst_row = idx
    src_off = _row_offset(src_row, SRC_PAGE, SRC_PAGE_STRIDE, SRC_TOK_STRIDE) + SRC_BASE
    dst_off = _row_offset(dst_row, DST_PAGE, DST_PAGE_STRIDE, DST_TOK_STRIDE) + DST_BASE
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    col_ok = cols < WIDTH
    vals = tl.load(src + src_off[:, None] + cols[None, :], mask=valid[:, None] & col_ok[None, :], other=0)
    if GATHER:
        store_ok = row_ok  # -1 rows are written as zeros
    else:
        store_ok = valid  # -1 rows are skipped
    tl.store(dst + dst_off[:, None] + cols[None, :], vals, mask=store_ok[:, None] & col_ok[None, :])


def _tile(width: int, word: int, num_rows: int) -> tuple[int, int, int]:
    """``(ROWS, BLOCK_W, num_warps)``: about 16 KB per program on GPU, much more when interpreting."""
    cap = max(1, 4096 // word)  # widest column block: 4 KB
    block_w = None
    c = cap
    while c >= 64:  # prefer a column block that divides the row (no masked lanes)
        if width % c == 0:
            block_w = c
            break
        c //= 2
    if block_w is None:
        block_w = min(triton.next_power_of_2(width), cap)
    target = (1 << 20 if interpreting() else 16384) // word
    rows = max(1, min(target // block_w, 1024, triton.next_power_of_2(max(num_rows, 1))))
    tile_bytes = rows * block_w * word
    return rows, block_w, 8 if tile_bytes >= 8192 else 4


def move_rows(
    src: torch.Tensor,
    dst: torch.Tensor,
    index: torch.Tensor,
    num_rows: int,
    width_bytes: int,
    src_layout: Layout,
    dst_layout: Layout,
    *,
    gather: bool,
    skip: tuple[int, int] | None = None,
    keep: bool = False,
) -> None:
    """Launch the row mover on byte buffers ``src``/``dst`` (2-D uint8, unit last stride).

    ``gather=True``: ``dst row r <- src row index[r]`` for ``r < num_rows``
    (zeros where ``index[r] == -1``); ``gather=False``: ``dst row index[r]
    <- src row r`` (skipped where ``-1``).  ``index``: int32/int64 ``[num_rows]``.
    ``skip=(lo, hi)`` (gather only): rows whose index lies in ``[lo, hi)`` are
    not written at all; with ``keep=True`` the opposite: only those rows are
    written, from ``src`` row ``index - lo`` (the folded rerange places its
    own rows and its peers' rows in two such passes).
    """
    if num_rows == 0 or width_bytes == 0:
        return
    if skip is None and dst_layout.page == 1 and dst_layout.tok_stride == 0 and segments.fits(width_bytes):
        # Narrow rows: whole rows per program in power-of-two pieces (no masked lanes); it checks extents itself.
        seg = segments.Segment(src, dst, src_layout, dst_layout.page_stride, width_bytes, dst_base=dst_layout.base)
        segments.move_segments([seg], index, num_rows, segments.GATHER if gather else segments.SCATTER)
        return
    bound = check_extents(src, dst, index, num_rows, width_bytes, src_layout, dst_layout, gather=gather)
    w = word_size(width_bytes, *src_layout.quantities(), *dst_layout.quantities(), tensors=(src, dst))
    word = WORD_DTYPES[w]
    src_w, dst_w = src.view(word), dst.view(word)
    width = width_bytes // w
    rows, block_w, warps = _tile(width, w, num_rows)
    sp, sps, sts, sb = src_layout.in_words(w)
    dp, dps, dts, db = dst_layout.in_words(w)
    grid = (triton.cdiv(num_rows, rows), triton.cdiv(width, block_w))
    lo, hi = skip if skip is not None else (0, 0)
    _MOVE_ROWS(
        grid,
        [src_w, dst_w, index, num_rows, bound, lo, hi, gather, sp, sps, sts, sb, dp, dps, dts, db, width, rows, block_w,
         0 if skip is None else (2 if keep else 1)],
        warps,
    )  # fmt: skip


_MOVE_ROWS = Launcher(_move_rows_kernel)


def check_extents(src, dst, index, num_rows: int, width_bytes: int, src_layout: Layout, dst_layout: Layout, *,
                  gather: bool) -> int:  # fmt: skip
    """Host-side shape checks of a row move; returns the index bound (rows of the indexed buffer).

    Shapes only (no device read, CUDA-graph safe): the kernel masks every
    index by the returned bound, and these checks make sure the rows it
    addresses *by position* (``r < num_rows``) and the bytes of every row
    exist too, so a launcher bug raises here instead of touching memory.
    """
    indexed, positional = (src, dst) if gather else (dst, src)
    at_i, at_p = (src_layout, dst_layout) if gather else (dst_layout, src_layout)
    if index is not None and index.shape[0] < num_rows:
        raise ValueError(f"cpgraph kernels: index has {index.shape[0]} entries for {num_rows} rows")
    if layout_rows(positional, at_p) < num_rows:
        raise ValueError(f"cpgraph kernels: {num_rows} rows do not fit a buffer of {layout_rows(positional, at_p)}")
    for t, at in ((src, src_layout), (dst, dst_layout)):
        if not layout_fits(t, at, width_bytes):
            raise ValueError(f"cpgraph kernels: {width_bytes}-byte rows at base {at.base} overrun a "
                             f"{tuple(t.shape)} buffer (page {at.page}, strides {at.page_stride}/{at.tok_stride})")  # fmt: skip
    return layout_rows(indexed, at_i)


# ------------------------------------------------------------- row ops
def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Provider of ``cpgraph::take_rows``: ``out[k] = x[index[k]]``, zero rows for ``-1``.

    ``x`` may have strided rows (materialisation passes a byte-column slice
    of the gathered buffer): only the selected bytes are read, no copy first.
    """
    out = torch.empty((index.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    src = byte_rows(x)
    dst = byte_rows(out)
    width = dst.shape[1]
    move_rows(src, dst, index, index.shape[0], width, Layout(src.stride(0)), Layout(width), gather=True)
    return out


def scatter_rows(dst: torch.Tensor, rows: torch.Tensor, index: torch.Tensor) -> None:
    """``dst[index[i]] = rows[i]`` for ``index[i] != -1`` (in place, ``dst`` rows may be strided)."""
    if rows.shape[0] == 0 or rows.numel() == 0:
        return
    if not _rows_contiguous(dst):  # a copy would swallow the writes: callers fall back
        raise ValueError("cpgraph kernels: the store target must have contiguous rows")
    d = byte_rows(dst)
    s = byte_rows(rows)
    move_rows(s, d, index, rows.shape[0], s.shape[1], Layout(s.stride(0)), Layout(d.stride(0)), gather=False)


def _rows_contiguous(t: torch.Tensor) -> bool:
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def compact_valid(x: torch.Tensor, valid_rows: torch.Tensor) -> torch.Tensor:
    """Provider of ``cpgraph::compact_valid``: a gather through ``valid_rows``."""
    return take_rows(x, valid_rows)


def restore_compute(y: torch.Tensor, valid_rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Provider of ``cpgraph::restore_compute``.

    The scatter ``out[valid_rows] = y`` is turned into a gather through the
    inverse index (``-1`` where no valid row lands), so every output row is
    written exactly once (no zero fill pass): three tiny index launches,
    then one row move.  An entry of ``valid_rows`` outside ``[0,
    num_rows)`` is redirected to a sentinel slot past the end of the
    inverse (never read), so its ``y`` row is dropped, as in the reference.
    """
    vr = valid_rows.to(torch.int64)
    target = torch.where((vr >= 0) & (vr < num_rows), vr, num_rows)
    inverse = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=y.device)
    inverse.index_copy_(0, target, torch.arange(y.shape[0], device=y.device))
    return take_rows(y, inverse[:num_rows])


# --------------------------------------------------- static-shape compaction
@triton.jit
def _valid_scan_kernel(row_kind, gather_index, restore_index, num_valid, M, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    """One program: positions of valid rows (``row_kind == 0``) by a chunked prefix sum.

    ``gather_index[j]``: row of the j-th valid row, ``-1`` for ``j >=
    num_valid`` (compaction); ``restore_index[i]``: rank of row i among the
    valid rows, ``-1`` for a dummy (restoration).  Both are what a stable
    sort on "is dummy" would give, without sorting.  The trip count is a
    constant (``M`` rounded up to a power of two, in ``BLOCK`` chunks): one
    compilation per size bucket, and the CPU interpreter cannot loop to a
    runtime bound.
    """
    carry = tl.zeros([1], dtype=tl.int32)
    for chunk in range(CHUNKS):
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        ok = offs < M
        kind = tl.load(row_kind + offs, mask=ok, other=1)
        v = (kind == 0) & ok
        pos = tl.cumsum(v.to(tl.int32), axis=0) + carry - 1
        tl.store(gather_index + pos, offs.to(tl.int64), mask=v)
        tl.store(restore_index + offs, tl.where(v, pos, -1).to(tl.int64), mask=ok)
        carry += tl.sum(v.to(tl.int32), axis=0)
    for chunk in range(CHUNKS):
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        tl.store(gather_index + offs, tl.full([BLOCK], -1, tl.int64), mask=(offs < M) & (offs >= carry))
    tl.store(num_valid + tl.arange(0, 1), carry.to(tl.int64))


def valid_scan(row_kind: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(gather_index [M], restore_index [M], num_valid int64 [1])`` from one launch."""
    m = row_kind.shape[0]
    gather_index = torch.empty(m, dtype=torch.int64, device=row_kind.device)
    restore_index = torch.empty(m, dtype=torch.int64, device=row_kind.device)
    num_valid = torch.empty(1, dtype=torch.int64, device=row_kind.device)
    bucket = max(triton.next_power_of_2(max(m, 1)), 128)
    block = min(bucket, 65536 if interpreting() else 4096)
    _valid_scan_kernel[(1,)](
        row_kind, gather_index, restore_index, num_valid, m, BLOCK=block, CHUNKS=bucket // block, num_warps=8
    )
    return gather_index, restore_index, num_valid


def compact_valid_static(x: torch.Tensor, row_kind: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Provider of ``cpgraph::compact_valid_static``: scan, then a gather (tail rows zero)."""
    gather_index, _, num_valid = valid_scan(row_kind)
    return take_rows(x, gather_index), num_valid


def restore_compute_static(y: torch.Tensor, row_kind: torch.Tensor) -> torch.Tensor:
    """Provider of ``cpgraph::restore_compute_static``: scan, then a gather (dummy rows zero)."""
    _, restore_index, _ = valid_scan(row_kind)
    return take_rows(y, restore_index)


# ---------------------------------------------------------------- paged ops
def paged_gather(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Provider of ``cpgraph::paged_gather`` (same contract as ``take_rows`` on a 2-D pool)."""
    return take_rows(pool, slots)


def paged_store(pool: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Provider of ``cpgraph::paged_store``: scatter rows into the pool, skipping ``-1``.

    A pool whose rows are not contiguous (never the case for pools the
    runtime allocates) takes the reference path: the kernel writes through
    the pool's storage, and a contiguous copy would swallow the writes.
    Counted and warned once (:mod:`cpgraph.ops.ledger`).
    """
    if not _rows_contiguous(pool):
        from cpgraph.ops import ledger
        from cpgraph.ops.paged import paged_store_reference
        from cpgraph.ops.providers import REFERENCE

        from .provider_name import PROVIDER_NAME

        ledger.fell_back("paged_store", pool.device.type, REFERENCE, "a pool whose rows are not contiguous",
                         instead_of=PROVIDER_NAME)
        return paged_store_reference(pool, rows, slots)
    scatter_rows(pool, rows, slots)


def index_k_gather(pages: torch.Tensor, slots: torch.Tensor, page_size: int, head_dim: int):
    """Provider of ``cpgraph::index_k_gather``: key bytes and scales of each slot's token.

    ONE launch of the multi-segment mover over the page bytes: per slot the
    index is read once, then the key segment (``head_dim`` bytes at
    ``offset * head_dim``) and the scale segment (``4 nb`` bytes after the
    page's ``page_size * head_dim`` key bytes) are moved, each with its own
    word size (8-byte words for 128 key bytes, one 4-byte word per scale).
    """
    n = slots.shape[0]
    nb = (head_dim + 127) // 128
    key_bytes = torch.empty((n, head_dim), dtype=torch.uint8, device=pages.device)
    scales = torch.empty((n, nb), dtype=torch.float32, device=pages.device)
    if n == 0:
        return key_bytes, scales
    if pages.shape[0] == 0:  # no page to read: every slot must be -1 (zero rows)
        return key_bytes.zero_(), scales.zero_()
    stride = pages.stride(0) if pages.shape[0] > 1 else pages.shape[1]
    keys_at = Layout(stride, page=page_size, tok_stride=head_dim)
    scales_at = Layout(stride, page=page_size, tok_stride=4 * nb, base=page_size * head_dim)
    scale_bytes = scales.view(torch.uint8)
    if not segments.fits(head_dim, 4 * nb):
        move_rows(pages, key_bytes, slots, n, head_dim, keys_at, Layout(head_dim), gather=True)
        move_rows(pages, scale_bytes, slots, n, 4 * nb, scales_at, Layout(4 * nb), gather=True)
        return key_bytes, scales
    segs = [
        segments.Segment(pages, key_bytes, keys_at, head_dim, head_dim),
        segments.Segment(pages, scale_bytes, scales_at, 4 * nb, 4 * nb),
    ]
    segments.move_segments(segs, slots, n, segments.GATHER)
    return key_bytes, scales
