"""``x @ w.T`` in fp32 for the model's fp32 weights (the router, the indexer's head weights).

Why this exists: both products are fp32 by the model's definition
(transformers keeps those weights in fp32 and upcasts ``x``), and on CUDA an
fp32 x fp32 GEMM runs on the CUDA cores (cuBLAS's SIMT kernel; TF32 is off
because it would round the operands).  At DeepSeek-V3.2's sizes that was
4.3 ms of a 200 ms two-layer forward at 32K tokens, for 0.2 TFLOP.

The same product on the tensor cores, without rounding anything the fp32
product would not round:

* ``x`` is a bf16 activation, so its upcast is exact in bf16;
* an fp32 weight is the exact sum of three bf16 parts ``hi + mid + lo``
  (``hi = bf16(w)``, ``mid = bf16(w - hi)``, ``lo = bf16(w - hi - mid)``:
  8 + 8 + 8 significand bits cover fp32's 24; the residues are exact in
  fp32);
* a bf16 x bf16 product is exact in fp32, and the tensor cores accumulate
  in fp32.

So one bf16 GEMM of ``x`` against ``[hi; mid; lo]`` (three times the output
columns) with fp32 output, and the sum of its three column blocks, is the
fp32 product up to the order of the additions -- the freedom every GEMM
kernel choice already takes.  Tested against the fp32 product in
``tests/models/test_fp32_linear.py``.

It runs on CUDA for bf16 activations only, and not inside the deterministic
mode: there the fp32 product is the row-invariant ``cpgraph::invariant_mm``
(docs/deterministic.md), which the split GEMM (``aten.mm.dtype``, cuBLAS)
would bypass.  Everything else computes ``F.linear(x.float(), w.float())``
as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from cpgraph.ops.invariant_mode import is_active as _deterministic


def bf16_parts(w: Tensor) -> Tensor:
    """``[3N, K]`` bf16 ``[hi; mid; lo]`` whose sum is ``w`` (fp32 ``[N, K]``) exactly.

    Recomputed on every call rather than cached on the module: it is one small fused elementwise pass
    over the weight (256 x 7168 for the router, about 5 us), and a derived copy could go stale when the
    weight is loaded or changed after the first forward.
    """
    w = w.float()
    hi = w.to(torch.bfloat16)
    r = w - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    return torch.cat((hi, mid, lo), dim=0)


def split_product(x: Tensor, w: Tensor) -> Tensor:
    """The tensor-core form: ``x`` bf16 ``[M, K]``, ``w`` ``[N, K]`` -> fp32 ``[M, N]`` (CUDA)."""
    n = w.shape[0]
    y = torch.mm(x, bf16_parts(w).t(), out_dtype=torch.float32)
    return (y[:, :n] + y[:, n : 2 * n]) + y[:, 2 * n :]


def uses_split(x: Tensor) -> bool:
    """Whether :func:`fp32_linear` takes the tensor-core form for this activation (static facts only)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and not _deterministic()


def fp32_linear(x: Tensor, w: Tensor) -> Tensor:
    """fp32 ``x @ w.T`` for an fp32 weight ``w [N, K]`` and a 2-D activation ``x [M, K]``."""
    if uses_split(x):
        return split_product(x, w)
    return F.linear(x.float(), w.float())
