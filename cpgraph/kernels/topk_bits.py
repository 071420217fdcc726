"""The bit encodings every stage of the top-k selection shares: rank bits and byte-packed step counts.

Why a module of their own: the window pass, the refinement and the collection
(:mod:`.topk_bracket`, :mod:`.topk_refine`, :mod:`.topk_collect`) all compare scores as
order-preserving 32-bit rank bits and read the row's list as rank bits, and the one-entry-a-thread
walks (``LIST_STEP``) of both the refinement and the collection count a round's four steps in the
bytes of one int32.  Written once here, each stage imports them and none imports another stage.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rank_bits(x):
    """fp32 -> uint32 whose unsigned order is the tie rule's score order.

    ``-0.0`` becomes ``0.0`` and every NaN the positive quiet NaN (above ``+inf``); then the sign
    bit is set for positives and all bits are flipped for negatives.
    """
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.uint32, bitcast=True)
    b = tl.where(x != x, tl.full(b.shape, 0x7FC00000, tl.uint32), b)
    neg = (b >> 31) != 0
    return tl.where(neg, b ^ 0xFFFFFFFF, b | 0x80000000)


@triton.jit
def _rank_float(r):
    """The fp32 whose rank bits are ``r`` (scalar; the inverse of :func:`_rank_bits` on canonical values)."""
    b = tl.where((r >> 31) != 0, r & 0x7FFFFFFF, r ^ 0xFFFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _list_load(ptr, i, n, off):
    """List entries ``ptr[i + off]`` (masked to ``i + off < n``) as rank bits.

    ``(ptr + i) + off``: loads of one round share an address and differ by an immediate offset.
    """
    return tl.load(ptr + i + off, mask=i + off < n, other=0).to(tl.uint32, bitcast=True)


@triton.jit
def _byte(x, b: tl.constexpr):
    """Byte ``b`` of the int32 ``x`` (8-bit packed counts)."""
    return (x >> (8 * b)) & 0xFF


@triton.jit
def _pack4(f0, f1, f2, f3):
    """Four 0/1 flags a lane (one per step of a round) packed into bytes of one int32."""
    return f0.to(tl.int32) | (f1.to(tl.int32) << 8) | (f2.to(tl.int32) << 16) | (f3.to(tl.int32) << 24)


@triton.jit
def _scan4(f0, f1, f2, f3):
    """The exclusive scan and the total of a round's four flags, in one packed scan (byte ``b``: step ``b``).

    Each step holds ``STEP < 256`` lanes, so no byte carries into the next (``_select_kernel`` checks it).
    """
    both = _pack4(f0, f1, f2, f3)
    return tl.cumsum(both, axis=0) - both, tl.sum(both, axis=0)
