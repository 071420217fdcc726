"""Triton ``silu(gate) * up`` of the bf16 routed experts' gate/up output, routed rows only.

Why: between the two bf16 grouped GEMMs the eager ``F.silu(gate) * up`` ran
as two elementwise kernels over every one of the ``M * top_k`` capacity rows
(a bf16 ``silu`` copy written and read back): 3.1 ms of a 242 ms two-layer
forward at DeepSeek-V3.2's sizes, 32K tokens (the op is opaque to Inductor,
so nothing fused it).  One kernel reads gate and up once and writes the
product once, and stops at the routed row count (``group_ends[-1]``, read on
the device: rows past it are never read by the down GEMM).

It rounds as the eager form does: ``silu`` rounded to the operand dtype,
then the product rounded again (``F.silu`` returns bf16, then ``*``), each
computed in fp32, so it differs from the eager kernels only where the two
``exp`` implementations differ.  Row-local, no host reads, every access
masked (docs/kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._bits import KINDS, KIND_BF16, load_f32, round_to_kind, store_f32_as
from ._launch import interpreting


@triton.jit
def _swiglu_kernel(h, group_ends, out, C, I, E, stride_h, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                   KIND: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    routed = tl.minimum(tl.maximum(tl.load(group_ends + E - 1).to(tl.int32), 0), C)
    ok = (rows < routed)[:, None] & (cols < I)[None, :]
    r64 = rows.to(tl.int64)
    gate = load_f32(h + r64[:, None] * stride_h + cols[None, :], ok, KIND)
    up = load_f32(h + r64[:, None] * stride_h + I + cols[None, :], ok, KIND)
    act = round_to_kind(gate / (1.0 + tl.exp(-gate)), KIND)
    store_f32_as(out + r64[:, None] * I + cols[None, :], act * up, ok, KIND)


def swiglu(h: Tensor, group_ends: Tensor) -> Tensor:
    """``h [C, 2I]`` (gate | up) -> ``silu(gate) * up`` ``[C, I]`` for rows ``< group_ends[-1]``.

    Rows past the routed count are left unwritten (they are never read).
    """
    c, two_i = h.shape
    i = two_i // 2
    out = torch.empty((c, i), dtype=h.dtype, device=h.device)
    if c == 0 or i == 0 or group_ends.numel() == 0:
        return out
    if h.stride(1) != 1:
        h = h.contiguous()
    rows, block = (4, 64) if interpreting() else (8, 256)
    kind = KINDS[h.dtype]
    src, dst = (h.view(torch.int16), out.view(torch.int16)) if kind == KIND_BF16 else (h, out)
    _swiglu_kernel[(triton.cdiv(c, rows), triton.cdiv(i, block))](
        src, group_ends, dst, c, i, group_ends.numel(), h.stride(0), ROWS=rows, BLOCK=block, KIND=kind, num_warps=4,
    )  # fmt: skip
    return out


__all__ = ["swiglu"]
