"""Multi-segment row mover: one index read, up to three byte segments moved per row.

Why a second row kernel next to ``move._move_rows_kernel``: rows of a few
hundred bytes (656-byte MLA records, 132-byte index-K tokens, 788-byte
packed materialisation rows) are where the generic column-block tiling
wastes work:

* a power-of-two column block over a 82-word row leaves 46 of 128 lanes
  masked; here a row is cut into at most three power-of-two *pieces*
  (82 = 64 + 16 + 2 words), so every lane moves a byte that is needed and
  each piece keeps the full vector width its alignment allows;
* an op that moves several segments per row (the key and scale parts of an
  index-K token, the payload kinds of a packed materialisation row) reads
  its index once and does it in one launch, instead of one launch per
  segment, each of which must re-read the index and which, for a 4-byte
  segment, ends up as a long skinny tile with almost no parallelism.

Each segment has its own word size (the widest of 8/4/2/1 bytes that
divides its widths, strides, offsets and pointers), its own source
addressing (``(row // PAGE) * PAGE_STRIDE + (row % PAGE) * TOK_STRIDE +
BASE``, the same form as :class:`.addressing.Layout`) and its own destination
(row-major with a row stride and a base column).  A segment may store more
words than it loads (``store > load``): the extra words are written as zeros,
which is how the materialisation pack fills its alignment padding.

Modes: ``GATHER`` (dst row r <- src row ``index[r]``, zero row for ``-1``),
``SCATTER`` (dst row ``index[r]`` <- src row r, ``-1`` skipped) and ``COPY``
(dst row r <- src row r, no index).  An index outside ``[0, bound)``
(``bound`` = rows of the indexed buffers, the smallest over the segments)
is treated exactly like ``-1`` and its row is addressed as row 0 under a
false mask, so no access ever leaves the tensors; the host checks the
positional side (rows ``r < num_rows``) and every segment's column extent
from shapes (:func:`move_segments`).  Grids depend on shapes only; nothing is
read back to the host, so launches are CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import Launcher, interpreting
from .addressing import WORD_DTYPES, Layout, layout_fits, word_size

GATHER, SCATTER, COPY = 0, 1, 2
MAX_SEGMENTS = 3
# Constexprs of an unused segment slot (after its two pointers, which repeat slot 0's).
UNUSED_SLOT = (1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0)
# Rows of at most this many bytes per segment go through this kernel; wider
# rows keep the column-block grid of ``move._move_rows_kernel``.
NARROW_BYTES = 4096


@triton.jit
def _piece(src, dst, s_off, d_off, load_ok, store_ok, COL: tl.constexpr, N: tl.constexpr, LW: tl.constexpr, SW: tl.constexpr):
    """Move words ``[COL, COL + N)`` of each row (masked against the load/store widths if they end inside)."""
    cols = COL + tl.arange(0, N)
    src_ptrs = src + s_off[:, None] + cols[None, :]
    dst_ptrs = dst + d_off[:, None] + cols[None, :]
    if COL + N <= LW:
        vals = tl.load(src_ptrs, mask=load_ok[:, None], other=0)
    else:
        vals = tl.load(src_ptrs, mask=load_ok[:, None] & (cols < LW)[None, :], other=0)
    if COL + N <= SW:
        tl.store(dst_ptrs, vals, mask=store_ok[:, None])
    else:
        tl.store(dst_ptrs, vals, mask=store_ok[:, None] & (cols < SW)[None, :])


@triton.jit
def _segment(
    src, dst, src_row, dst_row, load_ok, store_ok,
    SP: tl.constexpr, SPS: tl.constexpr, STS: tl.constexpr, SB: tl.constexpr,
    DS: tl.constexpr, DB: tl.constexpr, LW: tl.constexpr, SW: tl.constexpr,
    P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
):  # fmt: skip
    if SP == 1:
        s_off = src_row * SPS + SB
    else:
        s_off = (src_row // SP) * SPS + (src_row % SP) * STS + SB
    d_off = dst_row * DS + DB
    _piece(src, dst, s_off, d_off, load_ok, store_ok, 0, P0, LW, SW)
    if P1 > 0:
        _piece(src, dst, s_off, d_off, load_ok, store_ok, P0, P1, LW, SW)
    if P2 > 0:
        _piece(src, dst, s_off, d_off, load_ok, store_ok, P0 + P1, P2, LW, SW)


@triton.jit
def _segments_kernel(
    index, num_rows, bound,
    src0, dst0, SP0: tl.constexpr, SPS0: tl.constexpr, STS0: tl.constexpr, SB0: tl.constexpr, DS0: tl.constexpr,
    DB0: tl.constexpr, LW0: tl.constexpr, SW0: tl.constexpr, A0: tl.constexpr, B0: tl.constexpr, C0: tl.constexpr,
    src1, dst1, SP1: tl.constexpr, SPS1: tl.constexpr, STS1: tl.constexpr, SB1: tl.constexpr, DS1: tl.constexpr,
    DB1: tl.constexpr, LW1: tl.constexpr, SW1: tl.constexpr, A1: tl.constexpr, B1: tl.constexpr, C1: tl.constexpr,
    src2, dst2, SP2: tl.constexpr, SPS2: tl.constexpr, STS2: tl.constexpr, SB2: tl.constexpr, DS2: tl.constexpr,
    DB2: tl.constexpr, LW2: tl.constexpr, SW2: tl.constexpr, A2: tl.constexpr, B2: tl.constexpr, C2: tl.constexpr,
    MODE: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    r = rows.to(tl.int64)
    if MODE == 2:  # COPY
        src_row = r
        dst_row = r
        load_ok = row_ok
        store_ok = row_ok
    else:
        idx = tl.load(index + rows, mask=row_ok, other=-1).to(tl.int64)
        valid = row_ok & (idx >= 0) & (idx < bound)  # out of range == -1: never addressed
        idx = tl.where(valid, idx, 0)
        load_ok = valid
        if MODE == 0:  # GATHER: -1 rows are written as zeros
            src_row = idx
            dst_row = r
            store_ok = row_ok
        else:  # SCATTER: -1 rows are skipped
            src_row = r
            dst_row = idx
            store_ok = valid
    _segment(src0, dst0, src_row, dst_row, load_ok, store_ok, SP0, SPS0, STS0, SB0, DS0, DB0, LW0, SW0, A0, B0, C0)
    if K > 1:
        _segment(src1, dst1, src_row, dst_row, load_ok, store_ok, SP1, SPS1, STS1, SB1, DS1, DB1, LW1, SW1, A1, B1, C1)
    if K > 2:
        _segment(src2, dst2, src_row, dst_row, load_ok, store_ok, SP2, SPS2, STS2, SB2, DS2, DB2, LW2, SW2, A2, B2, C2)


def pieces(width: int) -> tuple[int, int, int]:
    """At most three power-of-two pieces covering ``width`` words, largest first.

    Exact (no masked lane) when ``width`` has at most three set bits (82 =
    64 + 16 + 2, 144 = 128 + 16, 99 = 64 + 32 + 3 -> 64 + 32 + 4 masked);
    otherwise the last piece is rounded up and masked.
    """
    if width <= 0:
        return 1, 0, 0
    out = []
    rest = width
    for _ in range(2):
        if rest == 0:
            break
        top = 1 << (rest.bit_length() - 1)
        out.append(top)
        rest -= top
    if rest:
        out.append(triton.next_power_of_2(rest))
    out += [0] * (3 - len(out))
    return out[0], out[1], out[2]


class Segment:
    """One byte segment of a row: where it is read, where it is written, how many bytes.

    ``src``/``dst``: 2-D uint8 buffers (unit last stride).  ``src_at``:
    byte addressing of source rows (:class:`.addressing.Layout`).  ``dst_stride`` /
    ``dst_base``: destination row stride and first column, in bytes.
    ``load_bytes`` bytes are read; ``store_bytes >= load_bytes`` are written
    (the excess as zeros).
    """

    __slots__ = ("src", "dst", "src_at", "dst_stride", "dst_base", "load_bytes", "store_bytes", "_geo")

    def __init__(self, src, dst, src_at: Layout, dst_stride: int, load_bytes: int, *, dst_base: int = 0, store_bytes=None):
        self.src, self.dst, self.src_at = src, dst, src_at
        self.dst_stride, self.dst_base = dst_stride, dst_base
        self.load_bytes = load_bytes
        self.store_bytes = load_bytes if store_bytes is None else store_bytes

    def word(self) -> int:
        return word_size(
            self.load_bytes, self.store_bytes, *self.src_at.quantities(), self.dst_stride, self.dst_base,
            tensors=(self.src, self.dst),
        )  # fmt: skip

    def args(self) -> tuple[list, int]:
        """Kernel arguments of this segment (pointers + constexprs) and its row bytes.

        The word size and constexprs depend only on the geometry and on the
        tensors' alignments mod 8, so they are computed once per such key
        (host time matters: these launches move a few MB at 32K tokens).
        """
        src, dst, at = self.src, self.dst, self.src_at
        key = (
            at.page, at.page_stride, at.tok_stride, at.base, self.dst_stride, self.dst_base,
            self.load_bytes, self.store_bytes, _align(src), _align(dst), src.shape[1], dst.shape[1], src.stride(0), dst.stride(0),
        )  # fmt: skip
        geo = _GEOMETRY.get(key)
        if geo is None:
            self.check_columns()
            w = self.word()
            sp, sps, sts, sb = at.in_words(w)
            sw = self.store_bytes // w
            a, b, c = pieces(sw)
            geo = _GEOMETRY[key] = (w, WORD_DTYPES[w], [sp, sps, sts, sb, self.dst_stride // w, self.dst_base // w,
                                                         self.load_bytes // w, sw, a, b, c])  # fmt: skip
        w, word, consts = geo
        self._geo = geo
        if w == 1:
            return [src, dst, *consts], self.store_bytes
        return [src.view(word), dst.view(word), *consts], self.store_bytes


    def check_columns(self) -> None:
        """Every row's bytes lie inside both buffers' rows (shapes only; once per geometry)."""
        dst = self.dst
        if not layout_fits(self.src, self.src_at, self.load_bytes):
            raise ValueError(f"cpgraph kernels: a {self.load_bytes}-byte segment at base {self.src_at.base} overruns "
                             f"its {tuple(self.src.shape)} source (page {self.src_at.page})")  # fmt: skip
        if not layout_fits(dst, Layout(self.dst_stride, base=self.dst_base), self.store_bytes):
            raise ValueError(f"cpgraph kernels: a {self.store_bytes}-byte segment at column {self.dst_base} overruns "
                             f"its {tuple(dst.shape)} destination (row stride {self.dst_stride})")  # fmt: skip
        if self.store_bytes < self.load_bytes:
            raise ValueError("cpgraph kernels: a segment must store at least the bytes it loads")


# (geometry, alignments, row widths) -> (word bytes, word dtype, constexprs); few distinct entries per model
_GEOMETRY: dict = {}


def _align(t) -> tuple[int, int, int, int]:
    """What :func:`.addressing.word_size` looks at in a tensor, reduced mod 8."""
    return t.data_ptr() % 8, t.storage_offset() % 8, t.stride(0) % 8, t.shape[-1] % 8


def fits(*row_bytes: int) -> bool:
    """Whether segments of these widths belong to this kernel (narrow rows, at most three)."""
    return 0 < len(row_bytes) <= MAX_SEGMENTS and all(0 < b <= NARROW_BYTES for b in row_bytes)


def move_segments(segments: list[Segment], index, num_rows: int, mode: int):
    """One launch moving every segment of ``num_rows`` rows (see the module docstring for ``mode``).

    Returns what a caller needs to repeat the launch for the same geometry
    (``grid, warps, trailing constexprs, per-segment (word, word dtype,
    constexprs)``), or ``None`` when nothing was launched.
    """
    if num_rows == 0 or not segments:
        return None
    if not 1 <= len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"cpgraph kernels: 1..{MAX_SEGMENTS} segments per launch, got {len(segments)}")
    bound = check_rows(segments, index, num_rows, mode)
    flat: list = []
    row_bytes = 0
    for seg in segments:
        vals, nbytes = seg.args()
        flat += vals
        row_bytes += nbytes
    for _ in range(MAX_SEGMENTS - len(segments)):  # unused slots: constexpr K disables them
        flat += [flat[0], flat[1], *UNUSED_SLOT]
    target = (1 << 22) if interpreting() else 16384  # bytes per program
    rows = 1 << max(0, (target // max(row_bytes, 1)).bit_length() - 1)
    rows = max(1, min(rows, 1024, triton.next_power_of_2(max(num_rows, 1))))
    warps = 8 if rows * row_bytes >= 8192 else 4
    if index is None:
        index = flat[0]  # never read in COPY mode
    grid = (triton.cdiv(num_rows, rows),)
    tail = [mode, len(segments), rows]
    _LAUNCH(grid, [index, num_rows, bound, *flat, *tail], warps)
    return grid, warps, tail, [seg._geo for seg in segments]


def check_rows(segments: list[Segment], index, num_rows: int, mode: int) -> int:
    """Host-side row checks of a launch (shapes only); returns the index bound.

    Rows addressed by position (``r < num_rows``: the destination of a
    gather, the source of a scatter, both for a copy) must exist; rows
    addressed through ``index`` are masked in the kernel by the returned
    bound, the fewest rows any segment's indexed buffer has.
    """
    if mode != COPY and (index is None or index.shape[0] < num_rows):
        raise ValueError(f"cpgraph kernels: the index must have at least {num_rows} entries")
    bound = None
    for k, seg in enumerate(segments):
        src_rows, dst_rows = seg.src.shape[0] * seg.src_at.page, seg.dst.shape[0]
        if mode == GATHER:
            positional, indexed = dst_rows, src_rows
        elif mode == SCATTER:
            positional, indexed = src_rows, dst_rows
        else:
            positional, indexed = min(src_rows, dst_rows), 0
        if positional < num_rows:
            raise ValueError(f"cpgraph kernels: segment {k} has {positional} rows for a launch over {num_rows}")
        bound = indexed if bound is None or indexed < bound else bound
    return bound


_LAUNCH = Launcher(_segments_kernel)
