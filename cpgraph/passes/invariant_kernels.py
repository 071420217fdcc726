"""Deterministic pass: every product in the graph becomes its row-invariant op (``CPConfig(deterministic=True)``).

Why a graph rewrite: a compiled graph's ``aten.mm`` is Inductor's to lower
(cuBLAS chosen by ``M``, a Triton template, an addmm split into mm + add),
and ``cpgraph::moe_experts`` / ``fp8_block_linear`` / ``mla_query`` run
providers whose GEMMs follow ``M`` or the routing.  After this pass the
graph holds the ``cpgraph::invariant_*`` ops of ``cpgraph/ops/invariant.py``
instead, opaque to Inductor, whose every row is computed in one fixed order
with one kernel configuration per weight shape.  The run-time half
(:mod:`cpgraph.ops.invariant_mode`, entered around each call of the compiled
forward) covers what no graph shows: the products inside other ops' CPU
references.  docs/deterministic.md.

Before::

    y = mm(x, t(w))                 y = addmm(b, x, t(w))        o = bmm(p, v)
    e = moe_experts(x, ids, w, gu, d, n)    f = fp8_block_linear(x, w8, s, 128, 128, p2)
    q = mla_query(q0, w_uk, cos, sin)

After::

    y = invariant_mm(x, t(w))       y = invariant_mm(x, t(w), b, 1, 1)   o = invariant_mm(p, v)
    e = invariant_moe_experts(x, ids, w, gu, d, n)   f = invariant_fp8_linear(x, w8, s, 128, 128, p2)
    q = invariant_mla_query(q0, w_uk, cos, sin)

It runs after the MoE and expert-parallel rewrites (they look for
``moe_experts``) and before collectives are lowered.  A product it has no
invariant form for (``_grouped_mm``, ``_scaled_mm``, ``mv``, ...) fails the
compile: a deterministic graph with a product left to chance would be the
silent fallback the mode exists to rule out.  With ``deterministic`` off the
pass changes nothing.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
from torch._inductor import config as inductor_config

import cpgraph.ops.invariant  # noqa: F401  (registers the cpgraph::invariant_* ops)
from cpgraph.ops.invariant import REPLACES
from cpgraph.ops.eager_numerics import NORMS, UNARY_CALLS, UNARY_METHODS

from .config import CPConfig
from .fx_utils import insert_call, op_name, op_of
from .graph_facts import PassMatchError

_aten = torch.ops.aten
_cp = torch.ops.cpgraph

# aten overloads -> how their arguments map onto invariant_mm(a, b, bias, beta, alpha).
_PRODUCTS = {
    _aten.mm.default: lambda a, b: (a, b),
    _aten.bmm.default: lambda a, b: (a, b),
    _aten.addmm.default: lambda bias, a, b, beta=1, alpha=1: (a, b, bias, float(beta), float(alpha)),
    _aten.baddbmm.default: lambda bias, a, b, beta=1, alpha=1: (a, b, bias, float(beta), float(alpha)),
}

# Products with no row-invariant form here: a deterministic compile refuses them.
REFUSED = {
    "aten._grouped_mm": "route experts through cpgraph::moe_experts (its invariant form is invariant_moe_experts)",
    "aten._scaled_mm": "use cpgraph::fp8_block_linear (its invariant form is invariant_fp8_linear)",
    "aten._scaled_grouped_mm": "route FP8 experts through cpgraph::moe_experts",
    "aten.mv": "no invariant matrix-vector product; write it as a product of 2-D tensors",
    "aten.addmv": "no invariant matrix-vector product; write it as a product of 2-D tensors",
    "aten.dot": "no invariant dot product; write it as a product of 2-D tensors",
    "aten.vdot": "no invariant dot product; write it as a product of 2-D tensors",
    "aten._int_mm": "no invariant integer GEMM",
    "aten.convolution": "no invariant convolution",
}


def _replace(graph: fx.Graph, node: fx.Node, target, args: tuple, kwargs: dict | None = None) -> None:
    with graph.inserting_before(node):
        new = insert_call(graph, target, args, kwargs)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def use_invariant_kernels(gm: fx.GraphModule, cfg: CPConfig) -> fx.GraphModule:
    """Swap every product for its ``cpgraph::invariant_*`` op when ``cfg.deterministic`` (module docstring)."""
    if not cfg.deterministic:
        return gm
    graph = gm.graph
    stand_ins = {getattr(_cp, op).default: getattr(_cp, inv).default for op, inv in REPLACES.items()}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        op = op_of(node)
        if op is not node.target:  # auto_functionalized(...): none of the replaced ops mutates
            continue
        if op in _PRODUCTS:
            _replace(graph, node, _cp.invariant_mm.default, _PRODUCTS[op](*node.args, **node.kwargs))
        elif op in stand_ins:  # same schema: the arguments carry over as they are
            _replace(graph, node, stand_ins[op], tuple(node.args), dict(node.kwargs))
        elif op_name(op) in REFUSED:
            raise PassMatchError(f"deterministic compile: {node.name} runs {op_name(op)}, which has no row-invariant "
                                 f"form: {REFUSED[op_name(op)]}", rule="invariant-products", nodes=[node])
    return gm


def keep_eager_numerics(gm: fx.GraphModule) -> fx.GraphModule:
    """On a Dynamo graph: norms and transcendental functions become ops Inductor cannot lower.

    ``rms_norm`` / ``layer_norm`` become ``cpgraph::invariant_rms_norm`` /
    ``invariant_layer_norm``; ``sigmoid``, ``silu``, ``exp``, ``sin``, ``cos``
    and the other functions of :data:`cpgraph.ops.eager_numerics.UNARY`
    (called as functions or as tensor methods, with one tensor argument)
    become ``cpgraph::eager_unary``.  It runs before AOT tracing, where
    Inductor would decompose a norm into a reduction of its own, so every
    graph of a deterministic compile computes these with the ATen kernels an
    eager forward runs (``cpgraph/ops/eager_numerics.py`` says why).  Returns
    ``gm``, changed in place.
    """
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        new_target, args = None, None
        if node.op == "call_function" and node.target in NORMS:
            name, params, defaults = NORMS[node.target]
            bound = {**defaults, **dict(zip(params, node.args))}
            bound.update({k: v for k, v in node.kwargs.items() if k in params})
            new_target, args = getattr(_cp, name).default, tuple(bound.get(p) for p in params)
        elif node.op == "call_function" and _is_unary_call(node, UNARY_CALLS.get(_hashable(node.target))):
            new_target, args = _cp.eager_unary.default, (node.args[0], UNARY_CALLS[node.target])
        elif node.op == "call_method" and _is_unary_call(node, UNARY_METHODS.get(node.target)):
            new_target, args = _cp.eager_unary.default, (node.args[0], UNARY_METHODS[node.target])
        if new_target is None:
            continue
        with graph.inserting_before(node):
            new = graph.call_function(new_target, args)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm


def _hashable(target):
    try:
        hash(target)
    except TypeError:
        return None
    return target


def _is_unary_call(node: fx.Node, name) -> bool:
    """A call of a known function on one tensor and nothing else (``F.gelu(x, approximate=..)`` stays Inductor's)."""
    return name is not None and len(node.args) == 1 and not node.kwargs and isinstance(node.args[0], fx.Node)


def run_mode(cfg: CPConfig):
    """What a call of a forward compiled with ``cfg`` runs inside: the deterministic mode, or nothing."""
    if not cfg.deterministic:
        return contextlib.nullcontext()
    from cpgraph.ops.invariant_mode import deterministic

    return deterministic()


# Inductor settings of a deterministic compile, where this torch has them (checked by name, so an older torch
# simply lacks the newer ones; docs/deterministic.md says what each one buys):
_INDUCTOR_SETTINGS = {
    "deterministic": True,  # no on-device benchmarking of configs that change numerics (reduction RBLOCK, ...)
    "batch_invariant": True,  # one per-row kernel config for every batch size (canonical size hints)
    "emulate_precision_casts": True,  # bf16 rounding where eager rounds; no FMA contraction
    "split_reductions": False,  # a row's reduction is never split across programs because its M is small
    # torch >= 2.13: eager's rounding inside fused kernels (division by div_rn, no flush-to-zero, the CUDA
    # toolkit's libdevice), so a fused chain gives the bits of ATen's kernels.
    "eager_numerics.division_rounding": True,
    "eager_numerics.disable_ftz": True,
    "eager_numerics.use_pytorch_libdevice": True,
}


def _has_setting(name: str) -> bool:
    obj = inductor_config
    for part in name.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def inductor_options(cfg: CPConfig) -> dict:
    """``torch.compile`` options for Inductor: the settings above when ``cfg.deterministic``, else none."""
    if not cfg.deterministic:
        return {}
    return {name: value for name, value in _INDUCTOR_SETTINGS.items() if _has_setting(name)}


__all__ = ["REFUSED", "inductor_options", "keep_eager_numerics", "run_mode", "use_invariant_kernels"]
