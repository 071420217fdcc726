"""Triton weighted combine of routed-expert outputs (one rounded row per token).

Each output row reads its ``top_k`` expert rows from the sorted buffer,
weights them in fp32 and writes one rounded row.  The torch form of that
step materialises ``[M, top_k, H]`` in fp32 (an upcast copy of every routed
activation); the kernel keeps it in registers, reads only routed positions
(sorted positions past the last group hold uninitialised memory and are
never addressed) and sums the slots in a fixed order, so a row's result is
deterministic and depends only on that row.

A module of its own because both expert paths end with it: the bf16
grouped-GEMM provider (:mod:`.moe`) and the FP8 grouped GEMM
(:mod:`.fp8_grouped`), which :mod:`.moe` dispatches to.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._launch import Launcher, interpreting


@triton.jit
def _combine_kernel(
    y,  # [C, H] sorted expert outputs
    slot_pos,  # int64 [M, K], -1 = slot routes nowhere
    w,  # fp32 [M, K]
    out,  # [M, H]
    num_rows,
    capacity,
    width,
    y_stride,
    out_stride,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < width
    rows64 = rows.to(tl.int64)
    acc = tl.zeros((ROWS, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(K):
        pos = tl.load(slot_pos + rows64 * K + j, mask=row_ok, other=-1).to(tl.int64)
        used = row_ok & (pos >= 0) & (pos < capacity)
        pos = tl.where(used, pos, 0)
        wj = tl.load(w + rows64 * K + j, mask=used, other=0.0)
        vals = tl.load(y + pos[:, None] * y_stride + cols[None, :], mask=used[:, None] & col_ok[None, :], other=0.0)
        acc += wj[:, None] * vals.to(tl.float32)
    tl.store(
        out + rows64[:, None] * out_stride + cols[None, :],
        acc.to(out.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


_COMBINE = Launcher(_combine_kernel)


def combine(y_sorted: Tensor, slot_pos: Tensor, topk_w: Tensor, out_dtype: torch.dtype) -> Tensor:
    """Triton form of :func:`cpgraph.ops.moe.combine_reference` (same signature, same result up to fp32 order)."""
    m, k = slot_pos.shape
    h = y_sorted.shape[1]
    out = torch.empty((m, h), dtype=out_dtype, device=y_sorted.device)
    if m == 0 or h == 0:
        return out
    if y_sorted.stride(1) != 1:
        y_sorted = y_sorted.contiguous()
    slot_pos = slot_pos.contiguous()
    topk_w = topk_w.contiguous()
    block_h = min(triton.next_power_of_2(h), 4096 if interpreting() else 512)
    rows = 64 if interpreting() else 4
    grid = (triton.cdiv(m, rows), triton.cdiv(h, block_h))
    _COMBINE(
        grid,
        [y_sorted, slot_pos, topk_w, out, m, y_sorted.shape[0], h, y_sorted.stride(0), out.stride(0), k, rows, block_h],
        4,
    )
    return out


__all__ = ["combine"]
