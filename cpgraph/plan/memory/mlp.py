"""The MLP half of a layer: a dense SwiGLU, or the router, the routed experts and the shared experts.

Why its own phase: it runs after the attention half with that half's
output, residual and the live top-k still held, and with ``ep > 1`` it adds
the expert-parallel dispatch and combine buffers around the local experts.
"""

from __future__ import annotations

from .experts import _routed_experts
from .op_bookings import _fp32_product
from .tape import _Tape


def _swiglu(t: _Tape, R: int, hidden: int, inner: int, a: int, name: str) -> None:
    """``down(silu(gate(x)) * up(x))``; leaves ``name`` ``[R, hidden]`` live."""
    t.alloc("gate", R * inner * a)
    t.alloc("silu", R * inner * a)
    t.free("gate")
    t.alloc("up", R * inner * a)
    t.alloc("prod", R * inner * a)
    t.free("silu", "up")
    t.alloc(name, R * hidden * a)
    t.free("prod")


def _mlp_layer(cfg, R: int, a: int, sparse: bool, topk_live: int, ep: int, split: bool, provider: str = "triton",
               fp8: bool = False, deterministic: bool = False) -> int:
    """Peak of a layer's MLP half above the base: ``attn``, ``x + attn``, its norm and the live top-k stay."""
    H, E, k, im = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    t = _Tape()
    t.alloc("topk", topk_live * 4 * R * cfg.index_topk)
    t.alloc("attn", R * H * a)
    t.alloc("x1", R * H * a)
    t.alloc("h", R * H * a)
    if not sparse:
        _swiglu(t, R, H, cfg.intermediate_size, a, "mlp")
    else:
        _fp32_product(t, "router.logits", R, H, E, a, split)  # fp32_linear(x, gate.weight)
        t.alloc("router.scores", 4 * R * E)
        t.free("router.logits")
        t.alloc("router.choice", 3 * 4 * R * E)  # choice, the expanded group mask, the masked choice
        t.alloc("topk_ids", 8 * R * k)
        t.alloc("topk_w", 4 * R * k)
        t.free("router.scores", "router.choice")
        if ep == 1:
            _routed_experts(t, provider, R, k, E, H, im, a, fp8, deterministic)
        else:
            # The expert-parallel reference (moe_dispatch / moe_combine decomposed): static capacity,
            # n = ep * R * min(k, E / ep) wire rows whatever the routing.
            n = ep * R * min(k, E // ep)
            t.alloc("ep.routes", 8 * (2 * n + R * k))
            t.alloc("ep.send", n * H * a)
            t.alloc("ep.wire", n * H * a)
            t.alloc("ep.recv", n * H * a)
            t.free("ep.send", "ep.wire")
            _routed_experts(t, provider, n, 1, E // ep, H, im, a, fp8, deterministic)  # the local experts
            t.free("ep.recv")
            t.alloc("ep.back_wire", n * H * a)
            t.alloc("ep.back", n * H * a)
            t.free("experts")
            t.alloc("ep.rows32", 2 * 4 * R * k * H)  # gathered fp32 rows, masked
            t.alloc("ep.sum32", 2 * 4 * R * H)
            t.alloc("experts", R * H * a)
            t.free("ep.back_wire", "ep.back", "ep.rows32", "ep.sum32", "ep.routes")
        _swiglu(t, R, H, im * cfg.n_shared_experts, a, "shared")
        t.alloc("mlp", R * H * a)
        t.free("experts", "shared", "topk_ids", "topk_w")
    t.alloc("x2", R * H * a)  # x + mlp
    return t.peak
