"""Row-local building blocks: RMSNorm, RoPE tables and rotations, the dense MLP.

Everything here maps ``[rows, ...] -> [rows, ...]`` with no mixing across
rows, which is what lets the CP compiler pass run these pieces on a rank's own
rows only.  Parameter names equal the Hugging Face names so that a state dict
maps one to one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cpgraph.ops.mla_query import rope_interleaved  # noqa: F401  (re-exported: the models' RoPE)

from .config import RopeConfig


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, statistics in fp32 (as transformers does), output in ``x``'s dtype.

    ``F.rms_norm`` rather than the written-out formula: on CUDA it is one
    fused kernel that keeps the fp32 statistics in registers, where the
    formula would materialise an fp32 copy of the whole activation (twice)
    in eager mode; under ``torch.compile`` both lower to the same fused code.
    In fp32 the two are the same arithmetic; in bf16 the fused form rounds
    once (after the weight) instead of twice, i.e. at least as accurate.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


class MLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` (dense layers and shared experts)."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ---------------------------------------------------------------------- RoPE
def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[Tensor, float]:
    """Inverse frequencies ``[dim/2]`` and the cos/sin amplitude factor.

    ``default``: ``theta^(-2i/dim)``, factor 1.  ``yarn``: per-frequency blend
    of interpolated (``/factor``) and original frequencies with a linear ramp
    between the correction dims for ``beta_fast``/``beta_slow`` rotations;
    the amplitude factor is ``attention_factor`` or ``mscale(factor, mscale) /
    mscale(factor, mscale_all_dim)`` (DeepSeek's form), as in the YaRN paper
    and transformers 5.24.
    """
    base = rope.theta
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    pos_freqs = base**exponents
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor
    attn = rope.attention_factor
    if attn is None:
        if rope.mscale and rope.mscale_all_dim:
            attn = float(_yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim))
        else:
            attn = _yarn_mscale(factor)

    def corr_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_original = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - keep_original) + (1.0 / pos_freqs) * keep_original
    return inv, attn


def softmax_scale(rope: RopeConfig, qk_head_dim: int) -> float:
    """MLA softmax scale: ``qk_head_dim^-0.5`` (not ``576^-0.5``), times yarn ``mscale_all_dim``^2."""
    scale = qk_head_dim**-0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = _yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return scale


def _stored_once(table: Tensor) -> Tensor:
    """``table`` itself; under ``torch.compile`` also a promise to Inductor that it is stored once.

    Why: Inductor inlines a cheap pointwise producer into every consumer
    unless it reads many buffers or has a long body, and ``cos``/``sin`` count
    as cheap on GPU.  The ``[M, dim/2]`` tables would then be recomputed per
    element of every consumer -- per (row, head, pair) in the fused query
    assembly (``cat(q_absorbed, rope(q_pe))``), 64 heads x 576 lanes of
    libdevice cos+sin per row, which made that kernel about 6x slower than
    its memory traffic on an H200.  Inductor's stride-order prim is the
    lowering that must materialise its input (it pins the layout), so the
    table becomes one small kernel and consumers load from it.  Same values:
    the table is computed by the same ops and already rounded to ``dtype``.
    Eager never runs it (nothing to realise there).
    """
    if not torch.compiler.is_compiling():
        return table
    return torch.ops.prims.inductor_force_stride_order(table, table.stride())


class RotaryTable(nn.Module):
    """Turns positions ``[M]`` into ``(cos, sin)`` of shape ``[M, dim/2]`` (one angle per pair).

    Computed once per forward and, compiled, stored once (``_stored_once``):
    every RoPE of every layer reads the same two small tables.
    """

    def __init__(self, rope: RopeConfig, dim: int):
        super().__init__()
        # Registers torch.ops.prims.inductor_force_stride_order (used by _stored_once when compiling).
        import torch._inductor.inductor_prims  # noqa: F401

        inv_freq, self.amplitude = rope_inv_freq(rope, dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos = angles.cos() * self.amplitude
        sin = angles.sin() * self.amplitude
        return _stored_once(cos.to(dtype)), _stored_once(sin.to(dtype))


def rope_neox(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate half-split pairs ``(x[i], x[i + dim/2])`` by angle ``i`` (NeoX / "rotate_half" style)."""
    half = x.shape[-1] // 2
    c = cos.view(cos.shape[0], *([1] * (x.dim() - 2)), half)
    s = sin.view(sin.shape[0], *([1] * (x.dim() - 2)), half)
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1)


ROPE_STYLES = {"interleaved": rope_interleaved, "neox": rope_neox}
