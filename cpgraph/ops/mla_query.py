"""``cpgraph::mla_query``: the sparse-MLA query ``[q_nope @ W_UK | rope(q_pe)]`` as one op.

Why an op: written as torch code, the absorption is a per-head bmm whose output is ``[H, M, L]``
while attention wants ``[M, H, L + R]``, so the compiler adds a pointwise kernel that reads the
bmm's output transposed and writes the concatenation: about 9.7 GB per layer at 32K tokens, at
under a third of the copy rate (6 % of a production-shape forward).  As one op, a provider can
have the GEMM write its result straight into the final layout (a strided batched GEMM's output
stride) and rotate only the 64 RoPE lanes: the assembly kernel disappears.  The reference is the
plain torch code; providers must agree with it to bf16 rounding (RoPE is computed in fp32 and
rounded once, as Inductor does).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_same_device, check_tensor
from .providers import select

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs ``(x[2i], x[2i+1])`` by angle ``i``; output keeps the interleaved layout.

    ``x``: ``[M, ..., dim]``; ``cos``/``sin``: ``[M, dim/2]``.  transformers returns the same
    values de-interleaved (``[evens | odds]``); both layouts give identical dot products, and this
    one is what serving engines cache.
    """
    shape = x.shape
    pairs = x.reshape(*shape[:-1], shape[-1] // 2, 2)
    c = cos.view(cos.shape[0], *([1] * (x.dim() - 2)), cos.shape[-1])
    s = sin.view(sin.shape[0], *([1] * (x.dim() - 2)), sin.shape[-1])
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * c - b * s, b * c + a * s), dim=-1).reshape(shape)


def _check_mla_query(q: Tensor, w_uk: Tensor, cos: Tensor, sin: Tensor) -> None:
    check_tensor("mla_query", "q", q, dtype=FLOATS, ndim=3)
    check_tensor("mla_query", "w_uk", w_uk, dtype=q.dtype, ndim=3, shape=(q.shape[1], None, None))
    nope = w_uk.shape[1]
    rope = q.shape[2] - nope
    if isinstance(rope, int) and (rope <= 0 or rope % 2):
        raise ValueError(f"cpgraph.mla_query: argument 'q' must hold w_uk's {nope} no-RoPE dims plus an even, "
                         f"positive number of RoPE dims, got head dim {q.shape[2]}")
    check_tensor("mla_query", "cos", cos, dtype=FLOATS, ndim=2, shape=(q.shape[0], rope // 2))
    check_tensor("mla_query", "sin", sin, dtype=cos.dtype, ndim=2, shape=(q.shape[0], rope // 2))
    check_same_device("mla_query", q=q, w_uk=w_uk, cos=cos, sin=sin)


def mla_query_reference(q: Tensor, w_uk: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    nope = w_uk.shape[1]
    q_nope, q_pe = q.split([nope, q.shape[2] - nope], dim=-1)
    q_abs = torch.einsum("mhn,hnl->mhl", q_nope, w_uk)
    return torch.cat((q_abs, rope_interleaved(q_pe, cos, sin).to(q_abs.dtype)), dim=-1)


@torch.library.custom_op("cpgraph::mla_query", mutates_args=())
def mla_query(q: Tensor, w_uk: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Sparse-MLA queries ``[M, H, L + R]`` from ``q [M, H, nope + R]`` and ``w_uk [H, nope, L]``.

    ``[..., :L] = q[..., :nope] @ w_uk`` per head; ``[..., L:]`` = interleaved RoPE of
    ``q[..., nope:]`` with ``cos``/``sin`` ``[M, R/2]``.  Output dtype: ``q``'s.
    """
    _check_mla_query(q, w_uk, cos, sin)
    return select("mla_query", q.device.type, mla_query_reference)(q, w_uk, cos, sin)


@mla_query.register_fake
def _mla_query_fake(q, w_uk, cos, sin):
    _check_mla_query(q, w_uk, cos, sin)
    return q.new_empty((q.shape[0], q.shape[1], w_uk.shape[2] + q.shape[2] - w_uk.shape[1]))


__all__ = ["mla_query", "mla_query_reference", "rope_interleaved"]
