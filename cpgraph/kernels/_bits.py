"""Bit-level number conversions shared by the codec kernels.

Every conversion the torch references perform (fp32 -> e4m3, e4m3 -> fp32,
fp32 -> bf16, the power-of-two scale) is written here with integer
operations on the IEEE bit patterns instead of the hardware/interpreter cast
instructions.  Why: the codecs are bit-exact contracts, and the rounding of
a cast differs between back ends (the Triton CPU interpreter has no bf16 or
fp8 numbers at all; some GPU paths saturate, some go through fp16).  Integer
arithmetic is the same everywhere.  The rules mirror c10's scalar
conversions (``c10/util/Float8_e4m3fn.h``, ``c10/util/BFloat16.h``): round to
nearest even, NaN kept as NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Operand kinds of a float tensor as the kernels load it.  bf16 is loaded as
# its int16 bit pattern (exact, and the interpreter has no bf16).
KIND_F32 = 0
KIND_BF16 = 1
KIND_F16 = 2
KINDS = {torch.float32: KIND_F32, torch.bfloat16: KIND_BF16, torch.float16: KIND_F16}  # dtype -> kind


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """A float tensor as the kernels take it: bf16 as its int16 bit pattern (``load_f32`` / ``store_f32_as``
    with ``KIND_BF16``), other dtypes as they are."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


@triton.jit
def load_f32(ptrs, mask, KIND: tl.constexpr):
    """Load floats of operand kind ``KIND`` and widen them to fp32 (exact)."""
    if KIND == 1:
        bits = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def bf16_bits(v):
    """fp32 -> bf16 bit pattern (int16), round to nearest even, NaN -> 0x7FC0."""
    b = v.to(tl.int32, bitcast=True)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
    return r.to(tl.int16)


@triton.jit
def round_to_kind(v, KIND: tl.constexpr):
    """fp32 -> operand kind ``KIND`` -> fp32 (round to nearest even): the rounding eager torch does when it
    stores an intermediate in the activation dtype (bf16 bit-level, as :func:`bf16_bits`)."""
    if KIND == 1:
        return (bf16_bits(v).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif KIND == 2:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def store_f32_as(ptrs, v, mask, KIND: tl.constexpr):
    """Store fp32 values as operand kind ``KIND`` (bf16 written as int16 bits)."""
    if KIND == 1:
        tl.store(ptrs, bf16_bits(v), mask=mask)
    elif KIND == 2:
        tl.store(ptrs, v.to(tl.float16), mask=mask)
    else:
        tl.store(ptrs, v, mask=mask)


@triton.jit
def pow2_exponent(amax):
    """``ceil(log2(max(amax, 1e-4) / 448))`` from the bits of ``amax`` (fp32 >= 0).

    With ``a = 1.m * 2**E`` (normal, since ``a >= 1e-4``), ``a / 448 =
    (1.m / 1.75) * 2**(E - 8)``; the factor lies in ``(0.57, 1]`` when
    ``1.m <= 1.75`` and in ``(1, 1.15)`` otherwise, so the ceiling is
    ``E - 8`` plus one when the mantissa field exceeds that of 1.75
    (``0x600000``).  This equals the reference's ``frexp`` of the rounded
    fp32 quotient because that quotient can land on a power of two only
    when the exact quotient is one (see ``cpgraph.ops.codecs.pow2_scale``).
    """
    a = tl.maximum(amax, 1e-4)
    bits = a.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)


@triton.jit
def exp2_f32(e):
    """``2.0 ** e`` for an int32 exponent in the normal range, built from bits (exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits(v):
    """fp32 -> e4m3fn byte (int32 in [0, 255]), round to nearest even.

    Mirrors c10: magnitudes below 2**-6 round through an fp32 addition of
    2**14 (whose ulp is the e4m3 subnormal step 2**-9); normal values round
    the mantissa to 3 bits with the "add 0x7FFFF + odd bit" trick and
    re-bias the exponent; magnitudes >= 480 become NaN (0x7F).  Callers
    clamp to +-448 first, as the reference does.
    """
    b = v.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    f = b & 0x7FFFFFFF
    fa = f.to(tl.float32, bitcast=True)
    sub = (fa + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    nor = (f + (-120 << 23) + 0x7FFFF + ((f >> 20) & 1)) >> 20
    r = tl.where(f < (121 << 23), sub, nor)
    r = tl.where(f >= (1087 << 20), 0x7F, r)
    return r | sign


@triton.jit
def e4m3_to_f32(byte):
    """e4m3fn byte (any int type) -> fp32, exact; NaN (0x7F/0xFF) -> c10's NaN pattern."""
    q = byte.to(tl.int32) & 0xFF
    sign = (q & 0x80) << 24
    e = (q >> 3) & 0xF
    m = q & 7
    normal = sign | ((e + 120) << 23) | (m << 20)
    sub = (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True) | sign
    r = tl.where(e == 0, sub, normal)
    r = tl.where((q & 0x7F) == 0x7F, sign | 0x7FF00000, r)
    return r.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_to_f32_fast(q):
    """Same bits as :func:`e4m3_to_f32` for a byte already widened to int32 (0..255), in fewer integer ops.

    Why: unpacking 656-byte records is bound by integer throughput, not
    bytes (the H200 runs half as many int32 as fp32 ops per clock), and the
    generic decode spends ~18 ops per value.  Here the 7 magnitude bits are
    placed into an fp16 bit pattern (``eeee mmm`` -> fp16 exponent/mantissa),
    whose value is the e4m3 value / 256 for normals AND subnormals (fp16
    subnormals are never flushed; the widening ``cvt`` is exact), then
    scaled by 256 exactly; the sign is ORed in and the NaN codes (magnitude
    0x7F) mapped to the same pattern as the generic decode.
    """
    half = (((q & 0x7F) << 7) | ((q & 0x80) << 8)).to(tl.int16)
    v = half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    nan = (((q & 0x80) << 24) | 0x7FF00000).to(tl.float32, bitcast=True)
    return tl.where((q & 0x7F) == 0x7F, nan, v)
