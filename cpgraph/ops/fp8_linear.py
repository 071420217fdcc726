"""Block-scaled FP8 linear layer: ``cpgraph::fp8_block_linear``.

Why an op: DeepSeek-V3.2 and GLM-5 are released with their linear weights in
e4m3 and one fp32 ``weight_scale_inv`` per 128 x 128 block.  Keeping them so
on the GPU halves the weight bytes and runs the projections on FP8 tensor
cores; as an op the model stays plain torch (one node per projection) and
the device decides how to compute it.

Contract (every provider computes the same function)::

    x  [M, K]   float (bf16 in production; fp16/fp32 accepted)
    w  [N, K]   float8_e4m3fn
    ws [ceil(N / bn), ceil(K / bk)] fp32           # weight_scale_inv, (bn, bk) = block
    out[m, n] = sum_k  deq(x)[m, k] * w[n, k] * ws[n // bn, k // bk]      -> dtype of x

where ``deq(x)`` is ``x`` quantised exactly the way the released recipe
does at run time ("dynamic" activations), per token per ``bk`` values:

    amax  = max |x[m, g*bk : (g+1)*bk]|             # one group
    scale = max(amax, 1e-4) / 448                   # fp32, IEEE-rounded division
            or 2 ** ceil(log2(max(amax, 1e-4) / 448))   when act_scale_pow2 (scale_fmt "ue8m0")
    q     = e4m3(clamp(x / scale, -448, 448))       # round to nearest even
    deq(x)= q * scale

So the reference and every kernel quantise the activations identically (the
same e4m3 codes and scales, bit for bit); they differ only in the order in
which fp32 products are summed.  A short last group (K not a multiple of
``bk``) is quantised on its own values.  A row is computed from that row
only.  A row holding a NaN or infinity has NaN in every output column (its
group scale is non-finite); other rows are unaffected.

Implementations: the torch reference below (CPU, and the oracle on CUDA);
``cpgraph.kernels.fp8_linear`` registers the CUDA provider (``torch``'s
blockwise-scaled FP8 GEMM where available, else a Triton kernel).  See
docs/ops/fp8_linear.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_same_device, check_tensor
from .codecs import FP8, FP8_MAX, SCALE_EPS, pow2_scale
from .providers import select

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
OP = "fp8_block_linear"
QUANT_OP = "fp8_quantize_activations"
QUANTIZED_OP = "fp8_linear_quantized"


def ceil_div(a, b):
    """``ceil(a / b)`` for ints and SymInts (no float round trip)."""
    return (a + b - 1) // b


def _check_block(name: str, value) -> None:
    if isinstance(value, torch.SymInt):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"cpgraph.{OP}: argument '{name}' must be a positive int, got {value!r}")


def check_fp8_block_linear(x, weight, weight_scale_inv, block_n, block_k) -> None:
    """Metadata checks shared by the op, its fake rule and the providers (no data read)."""
    _check_block("block_n", block_n)
    _check_block("block_k", block_k)
    check_tensor(OP, "x", x, dtype=FLOATS, ndim=2)
    k = x.shape[1]
    check_tensor(OP, "weight", weight, dtype=FP8, ndim=2, shape=(None, k))
    n = weight.shape[0]
    check_tensor(OP, "weight_scale_inv", weight_scale_inv, dtype=torch.float32,
                 shape=(ceil_div(n, block_n), ceil_div(k, block_k)))
    check_same_device(OP, x=x, weight=weight, weight_scale_inv=weight_scale_inv)


# -------------------------------------------------------------- reference
def activation_scales(amax: Tensor, pow2: bool) -> Tensor:
    """Per-group decode scales from the groups' ``amax`` (fp32), by the recipe in the module docstring.

    A non-finite ``amax`` (the group holds a NaN or an infinity) gives a NaN
    scale, so the whole group decodes to NaN: a stated outcome every
    provider reproduces, where the power-of-two rounding would otherwise
    turn an infinite ``amax`` into some arbitrary finite scale.
    """
    amax = amax.to(torch.float32)
    scales = pow2_scale(amax) if pow2 else amax.clamp_min(SCALE_EPS) / FP8_MAX
    return torch.where(torch.isfinite(amax), scales, torch.full((), float("nan"), device=amax.device))


def quantize_activations(x: Tensor, group: int, pow2: bool) -> tuple[Tensor, Tensor]:
    """``x [M, K]`` -> ``(e4m3 [M, K], fp32 scales [M, ceil(K / group)])``, per token per ``group`` values."""
    m, k = x.shape
    g = ceil_div(k, group)
    xf = x.to(torch.float32)
    if g * group != k:  # short last group: zeros never raise an amax
        xf = torch.nn.functional.pad(xf, (0, g * group - k))
    xf = xf.view(m, g, group)
    scales = activation_scales(xf.abs().amax(dim=-1), pow2)
    q = (xf / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, g * group)[:, :k], scales


def dequantize_weight(weight: Tensor, weight_scale_inv: Tensor, block_n: int, block_k: int) -> Tensor:
    """``e4m3 [N, K] * scale of its block`` in fp32 (the checkpoint recipe's dequantisation)."""
    n, k = weight.shape
    s = weight_scale_inv.to(torch.float32)
    s = s.repeat_interleave(block_n, dim=0)[:n].repeat_interleave(block_k, dim=1)[:, :k]
    return weight.to(torch.float32) * s


def fp8_block_linear_reference(x, weight, weight_scale_inv, block_n, block_k, act_scale_pow2):
    """Dequantise both operands to fp32 and multiply (the definition, summed by torch's fp32 GEMM)."""
    q, scales = quantize_activations(x, block_k, act_scale_pow2)
    return fp8_linear_quantized_reference(q, scales, weight, weight_scale_inv, block_n, block_k, x.dtype)


def fp8_linear_quantized_reference(xq, x_scales, weight, weight_scale_inv, block_n, block_k, out_dtype):
    """The GEMM half of the definition: codes times their scales, in fp32, to ``out_dtype``."""
    k = xq.shape[1]
    x_deq = xq.to(torch.float32) * x_scales.to(torch.float32).repeat_interleave(block_k, dim=1)[:, :k]
    w_deq = dequantize_weight(weight, weight_scale_inv, block_n, block_k)
    return (x_deq @ w_deq.t()).to(out_dtype)


def column_major(scales: Tensor) -> Tensor:
    """``[M, G]`` with strides ``(1, M)``: the scale layout the SM90 FP8 GEMMs read without a transpose.

    Already so laid out (or one row, where the layouts coincide): returned as it is, no copy.
    """
    m = scales.shape[0]
    return scales if scales.stride() == (1, m) or m <= 1 else scales.t().contiguous().t()


def quantize_activations_reference(x, group, pow2):
    q, scales = quantize_activations(x, group, pow2)
    return q.contiguous(), column_major(scales)


# --------------------------------------------------------------------- op
@torch.library.custom_op("cpgraph::fp8_block_linear", mutates_args=())
def fp8_block_linear(
    x: Tensor, weight: Tensor, weight_scale_inv: Tensor, block_n: int, block_k: int, act_scale_pow2: bool
) -> Tensor:
    """``x @ dequant(weight)^T`` with per-token-group FP8 activations; ``[M, N]`` in ``x``'s dtype.

    ``weight`` float8_e4m3fn ``[N, K]``; ``weight_scale_inv`` fp32
    ``[ceil(N / block_n), ceil(K / block_k)]``; activations are quantised
    per token per ``block_k`` values with fp32 scales, or power-of-two
    scales when ``act_scale_pow2`` (module docstring).
    """
    check_fp8_block_linear(x, weight, weight_scale_inv, block_n, block_k)
    impl = select(OP, x.device.type, fp8_block_linear_reference)
    return impl(x, weight, weight_scale_inv, block_n, block_k, act_scale_pow2)


@fp8_block_linear.register_fake
def _fp8_block_linear_fake(x, weight, weight_scale_inv, block_n, block_k, act_scale_pow2):
    check_fp8_block_linear(x, weight, weight_scale_inv, block_n, block_k)
    return x.new_empty((x.shape[0], weight.shape[0]))


# ------------------------------------------------ the same function in two ops
# ``fp8_block_linear`` = ``fp8_linear_quantized(*fp8_quantize_activations(x))``, bit for bit in the codes and
# scales.  Why two more ops: several projections read the same activation (V3.2's q_a, kv_a and the
# indexer's wk; an MLP's gate and up), and quantising it once for all of them saves a full read of it per
# extra projection (the pass ``share_activation_quantization``; docs/ops/fp8_linear.md).
def check_quantize_activations(x, group) -> None:
    _check_block("group", group)
    check_tensor(QUANT_OP, "x", x, dtype=FLOATS, ndim=2)


@torch.library.custom_op("cpgraph::fp8_quantize_activations", mutates_args=())
def fp8_quantize_activations(x: Tensor, group: int, pow2: bool) -> tuple[Tensor, Tensor]:
    """``x [M, K]`` -> ``(e4m3 [M, K], fp32 scales [M, ceil(K / group)])`` by ``fp8_block_linear``'s recipe.

    The scales are laid out column-major (strides ``(1, M)``), the layout the SM90 GEMMs read.
    """
    check_quantize_activations(x, group)
    impl = select(QUANT_OP, x.device.type, quantize_activations_reference)
    return impl(x, group, pow2)


@fp8_quantize_activations.register_fake
def _fp8_quantize_activations_fake(x, group, pow2):
    check_quantize_activations(x, group)
    m, k = x.shape
    return x.new_empty((m, k), dtype=FP8), x.new_empty((ceil_div(k, group), m), dtype=torch.float32).t()


def check_fp8_linear_quantized(xq, x_scales, weight, weight_scale_inv, block_n, block_k, out_dtype) -> None:
    _check_block("block_n", block_n)
    _check_block("block_k", block_k)
    if out_dtype not in FLOATS:
        raise ValueError(f"cpgraph.{QUANTIZED_OP}: argument 'out_dtype' must be one of {FLOATS}, got {out_dtype}")
    check_tensor(QUANTIZED_OP, "xq", xq, dtype=FP8, ndim=2)
    m, k = xq.shape
    check_tensor(QUANTIZED_OP, "x_scales", x_scales, dtype=torch.float32, shape=(m, ceil_div(k, block_k)))
    check_tensor(QUANTIZED_OP, "weight", weight, dtype=FP8, ndim=2, shape=(None, k))
    n = weight.shape[0]
    check_tensor(QUANTIZED_OP, "weight_scale_inv", weight_scale_inv, dtype=torch.float32,
                 shape=(ceil_div(n, block_n), ceil_div(k, block_k)))
    check_same_device(QUANTIZED_OP, xq=xq, x_scales=x_scales, weight=weight, weight_scale_inv=weight_scale_inv)


@torch.library.custom_op("cpgraph::fp8_linear_quantized", mutates_args=())
def fp8_linear_quantized(
    xq: Tensor, x_scales: Tensor, weight: Tensor, weight_scale_inv: Tensor, block_n: int, block_k: int,
    out_dtype: torch.dtype,
) -> Tensor:
    """``fp8_block_linear`` on activations already quantised (``fp8_quantize_activations``); ``[M, N]`` ``out_dtype``.

    ``x_scales`` may have any strides; the SM90 GEMMs read column-major ones without a copy.
    """
    check_fp8_linear_quantized(xq, x_scales, weight, weight_scale_inv, block_n, block_k, out_dtype)
    impl = select(QUANTIZED_OP, xq.device.type, fp8_linear_quantized_reference)
    return impl(xq, x_scales, weight, weight_scale_inv, block_n, block_k, out_dtype)


@fp8_linear_quantized.register_fake
def _fp8_linear_quantized_fake(xq, x_scales, weight, weight_scale_inv, block_n, block_k, out_dtype):
    check_fp8_linear_quantized(xq, x_scales, weight, weight_scale_inv, block_n, block_k, out_dtype)
    return xq.new_empty((xq.shape[0], weight.shape[0]), dtype=out_dtype)
