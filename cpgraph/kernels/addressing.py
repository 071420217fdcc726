"""Byte addressing of rows, shared by the two row movers (:mod:`.move`, :mod:`.segments`).

A buffer is viewed as 2-D ``uint8`` rows (:func:`byte_rows`); a row's first
byte is ``(r // page) * page_stride + (r % page) * tok_stride + base``
(:class:`Layout`: plain rows with ``page == 1``, token slices of fp8
index-K pages otherwise), and rows travel as the widest machine word that
divides every width, stride, offset and pointer (:func:`word_size`).  Both
movers address rows this way and check extents against it
(:func:`layout_fits`); keeping it here lets :mod:`.move` hand narrow rows
to :mod:`.segments` without the two importing each other.  Host-side
shape arithmetic only: nothing reads device memory.
"""

from __future__ import annotations

import torch

WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class Layout:
    """Byte addressing of rows in a buffer: ``(r // page) * page_stride + (r % page) * tok_stride + base``."""

    __slots__ = ("page", "page_stride", "tok_stride", "base")

    def __init__(self, page_stride: int, *, page: int = 1, tok_stride: int = 0, base: int = 0):
        self.page, self.page_stride, self.tok_stride, self.base = page, page_stride, tok_stride, base

    def quantities(self) -> tuple[int, ...]:
        return (self.page_stride, self.tok_stride, self.base)

    def in_words(self, w: int) -> tuple[int, int, int, int]:
        return self.page, self.page_stride // w, self.tok_stride // w, self.base // w


def byte_rows(t: torch.Tensor) -> torch.Tensor:
    """``t [N, ...]`` as ``uint8 [N, row_bytes]`` sharing memory (rows may be strided).

    The trailing dims must be contiguous within a row; if they are not, a
    contiguous copy is taken (never the case for the ops' own call sites).
    """
    n = t.shape[0]
    if n > 1 and t.dim() == 2 and t.stride(1) == 1:  # the common case, without the general walk below
        return t if t.dtype == torch.uint8 else t.view(torch.uint8)
    expected, ok = 1, True
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            ok = False
        expected *= size
    if not ok:
        t = t.contiguous()
    width = 1
    for size in t.shape[1:]:
        width *= size
    rows = t.as_strided((n, width), (t.stride(0) if n > 1 else width, 1))
    return rows.view(torch.uint8)


def word_size(*quantities: int, tensors=()) -> int:
    """Largest word (8/4/2/1 bytes) dividing every byte quantity and tensor alignment."""
    for w in (8, 4, 2, 1):
        if all(q % w == 0 for q in quantities) and all(
            t.data_ptr() % w == 0 and t.storage_offset() % w == 0 and t.stride(0) % w == 0 and t.shape[-1] % w == 0
            for t in tensors
        ):
            return w
    return 1


def layout_rows(t: torch.Tensor, at: Layout) -> int:
    """Rows of ``t`` (2-D byte buffer) addressable through ``at``: ``pages * page``."""
    return t.shape[0] * at.page


def layout_fits(t: torch.Tensor, at: Layout, width_bytes: int) -> bool:
    """Whether every row of ``at`` (``width_bytes`` from its address) lies inside ``t``'s rows.

    Row ``r`` starts at ``(r // page) * page_stride + (r % page) * tok_stride
    + base``; the last in-page token must end within ``t``'s row, and the
    page stride must be ``t``'s own (or ``t`` has a single row).
    """
    last = at.base + (at.page - 1) * at.tok_stride + width_bytes
    stride_ok = t.shape[0] <= 1 or at.page_stride == t.stride(0)
    return min(at.base, at.tok_stride, at.page_stride) >= 0 and last <= t.shape[1] and stride_ok


__all__ = ["WORD_DTYPES", "Layout", "byte_rows", "layout_fits", "layout_rows", "word_size"]
