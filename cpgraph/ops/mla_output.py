"""``cpgraph::mla_output``: the sparse-MLA output's value absorption, ``out_lat @ W_UV^T``, as ``[M, H * v]`` rows.

Why an op: written as torch code (``einsum("mhl,hvl->mhv").reshape(M, H * v)``), the absorption is a
per-head bmm whose output is ``[H, M, v]`` while ``o_proj`` reads ``[M, H * v]``, so the compiler adds a
kernel that reads the bmm's output transposed and writes it again: 2 GB per layer at 32K tokens x 128
heads, about 0.5 ms a layer on an H200 (the 32K profiles' ``clone_permute_view`` kernel).  As one op, a
provider can have the GEMM write its result straight into the rows ``o_proj`` reads (a strided batched
GEMM's output stride), as ``cpgraph::mla_query`` does on the query side.  The reference is the plain
torch code; providers agree with it to the GEMM's summation order (bf16 rounding of the same products).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_same_device, check_tensor
from .providers import select

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def check_mla_output(out_lat: Tensor, w_uv: Tensor, op: str = "mla_output") -> None:
    check_tensor(op, "out_lat", out_lat, dtype=FLOATS, ndim=3)
    check_tensor(op, "w_uv", w_uv, dtype=out_lat.dtype, ndim=3, shape=(out_lat.shape[1], None, out_lat.shape[2]))
    check_same_device(op, out_lat=out_lat, w_uv=w_uv)


def mla_output_reference(out_lat: Tensor, w_uv: Tensor) -> Tensor:
    m, h, _ = out_lat.shape
    return torch.einsum("mhl,hvl->mhv", out_lat, w_uv).reshape(m, h * w_uv.shape[1])


@torch.library.custom_op("cpgraph::mla_output", mutates_args=())
def mla_output(out_lat: Tensor, w_uv: Tensor) -> Tensor:
    """``[M, H * v]``: row ``m``, head ``h`` holds ``out_lat[m, h] @ w_uv[h]^T`` (``out_lat [M, H, L]``, ``w_uv [H, v, L]``)."""
    check_mla_output(out_lat, w_uv)
    return select("mla_output", out_lat.device.type, mla_output_reference)(out_lat, w_uv)


@mla_output.register_fake
def _mla_output_fake(out_lat, w_uv):
    check_mla_output(out_lat, w_uv)
    return out_lat.new_empty((out_lat.shape[0], out_lat.shape[1] * w_uv.shape[1]))


__all__ = ["mla_output", "mla_output_reference", "check_mla_output"]
