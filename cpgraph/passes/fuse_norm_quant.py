"""Quantise an FP8 projection's input inside the RMSNorm that produces it.

Why: the DSA family's FP8 projection groups all read a normed activation
(``q_a`` / ``kv_a`` / ``wk`` read ``input_layernorm(x + mlp)``, ``q_b`` /
``wq_b`` read ``q_a_layernorm(q_a(x))``, a dense MLP's ``gate`` / ``up``
read ``post_attention_layernorm(x + attn)``).  Unfused, Inductor's
add + norm kernel writes the bf16 normed rows and the quantiser reads them
back; ``cpgraph::fp8_rms_norm_quantize`` does the add, the norm and the
quantisation in one row-local pass (cpgraph/ops/norm_quant.py,
docs/ops/fp8_linear.md).

Rewrite, where the input of an ``fp8_quantize_activations`` (left by
``share_activation_quantization``) or of a lone ``fp8_block_linear`` is
(a flattening view of) an RMSNorm as torch decomposes ``F.rms_norm``, and
the norm's input is, optionally, a same-shape residual add::

    s  = a + b                                      s2, h2, q, sc = fp8_rms_norm_quantize(a, b, w, eps, g, p, emit)
    h  = rms_norm(s) * w        (decomposed)   ->   y1 = fp8_linear_quantized(q, sc, w1, s1, ...)
    q, sc = fp8_quantize_activations(h.view(-1, K), g, p)
    y1 = fp8_linear_quantized(q, sc, w1, s1, ...)   (s's other readers read s2; h's read h2, which is written
                                                     only if there are any: emit)

The unfused norm, left without readers, is removed.  Numerics: the codes are
those of the ``h`` the op returns; that ``h`` may differ from the unfused
norm's in the last bit of a value (another summation order of the row's
squares), which the tests bound against the unrewritten graph.  Rows stay
independent, so CP still equals the single device.

Not rewritten: a deterministic compile (``use_invariant_kernels`` has
already replaced the FP8 projections there; the norm's eager kernel is the
invariant one), an activation dtype other than bf16 / fp16 / fp32, and a
norm whose inputs are defined after its first reader (never produced by
torch's decomposition; checked rather than assumed).  Finding nothing is not
an error: bf16 models have no FP8 projection.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .cleanup import eliminate_dead_code
from .config import CPConfig
from .fx_utils import FP8_LINEAR_ARGS, FP8_QUANTIZE_ARGS, VIEW_OPS, call_args, find_nodes, insert_call, is_op, op_of
from .graph_facts import order_of, tensor_val

aten, prims = torch.ops.aten, torch.ops.prims
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_QUANT, _LINEAR = "cpgraph.fp8_quantize_activations", "cpgraph.fp8_block_linear"


@dataclass
class NormMatch:
    """One decomposed ``rms_norm(s) * w`` whose (flattened) output an FP8 quantisation reads."""

    out: fx.Node  # h: the norm's output in s's dtype
    s: fx.Node  # the norm's input
    weight: fx.Node  # the weight as the norm multiplies it (after its cast to s's dtype)
    eps: float
    chain: tuple  # the norm's own nodes (left dead after the rewrite)
    residual: tuple | None = None  # (a, b) when s = a + b


def fuse_norm_into_quantization(gm: fx.GraphModule, cfg: CPConfig | None = None) -> fx.GraphModule:
    if cfg is not None and cfg.deterministic:
        return gm
    graph = gm.graph
    if not find_nodes(graph, _QUANT, _LINEAR):  # no FP8 projection (a bf16 model): nothing to look at
        return gm
    eliminate_dead_code(gm)  # views left without readers by share_activation_quantization are not readers of h
    for site in find_nodes(graph, _QUANT, _LINEAR):
        x = _site_recipe(site)[0]
        match = match_rms_norm(x)
        if match is None:
            continue
        order = order_of(graph)  # once per site: a rewrite inserts nodes
        if _placeable(order, match, site, x):
            _rewrite(graph, order, site, x, match)
    eliminate_dead_code(gm)  # the unfused norms
    graph.lint()
    gm.recompile()
    return gm


# ----------------------------------------------------------------- matching
def _strip_cast(node, dtype=None):
    """``node`` without a dtype conversion in front of it (``dtype``: only a conversion to it)."""
    if isinstance(node, fx.Node) and (is_op(node, "prims.convert_element_type") or _is_plain_to_copy(node)):
        to = node.args[1] if is_op(node, "prims.convert_element_type") else node.kwargs.get("dtype")
        if dtype is None or to == dtype:
            return node.args[0]
    return node


def _is_plain_to_copy(node) -> bool:
    return is_op(node, "aten._to_copy") and set(node.kwargs) <= {"dtype", "layout", "device"}


def _two(node, target):
    """``node``'s two tensor args if it runs ``target``, else ``None``."""
    if op_of(node) is not target or node.kwargs or len(node.args) != 2:
        return None
    return node.args


def match_rms_norm(x) -> NormMatch | None:
    """The norm ``x`` is (a view of), as ``F.rms_norm`` decomposes; ``None`` if it is not one."""
    if not isinstance(x, fx.Node):
        return None
    xval = tensor_val(x)
    out = x
    while is_op(out, *VIEW_OPS) and isinstance(out.args[0], fx.Node):
        out = out.args[0]
    oval = tensor_val(out)
    if xval is None or oval is None or oval.dtype not in _FLOATS or xval.dim() != 2 or oval.dim() < 1:
        return None
    k = oval.shape[-1]
    if xval.shape[-1] != k or not oval.is_contiguous():  # the view must flatten the leading dims
        return None
    prod = _strip_cast(out)  # fp32 product (no cast for fp32 activations)
    pair = _two(prod, aten.mul.Tensor)
    if pair is None:
        return None
    for normalized, weight in (pair, pair[::-1]):
        wval = tensor_val(weight)
        inner = _two(normalized, aten.mul.Tensor)
        if wval is None or wval.shape != (k,) or inner is None:
            continue
        for xf, rsqrt in (inner, inner[::-1]):
            found = _match_rsqrt(rsqrt, xf)
            if found is None:
                continue
            eps, stats = found
            s = _strip_cast(xf, torch.float32)
            sval = tensor_val(s)
            if sval is None or sval.dtype != oval.dtype or tuple(sval.shape) != tuple(oval.shape):
                continue
            chain = tuple(n for n in (out, prod, normalized, xf, rsqrt, *stats) if n is not s)
            return NormMatch(out, s, weight, eps, chain, _residual_add(s))
    return None


def _match_rsqrt(rsqrt, xf):
    """``rsqrt(mean(xf ** 2, -1, keepdim) + eps)`` -> ``(eps, its nodes)``."""
    if op_of(rsqrt) is not aten.rsqrt.default:
        return None
    add = rsqrt.args[0]
    if op_of(add) is not aten.add.Scalar or not isinstance(add.args[1], (int, float)) or add.kwargs:
        return None
    mean = add.args[0]
    if op_of(mean) is not aten.mean.dim or mean.kwargs or len(mean.args) != 3 or mean.args[2] is not True:
        return None
    pow_, dims = mean.args[0], mean.args[1]
    val = tensor_val(pow_)
    if val is None or list(dims) not in ([-1], [val.dim() - 1]):
        return None
    if op_of(pow_) is not aten.pow.Tensor_Scalar or pow_.args[0] is not xf or pow_.args[1] != 2:
        return None
    return float(add.args[1]), (add, mean, pow_)


def _residual_add(s):
    pair = _two(s, aten.add.Tensor)
    if pair is None or not all(isinstance(t, fx.Node) for t in pair):
        return None
    sval, vals = tensor_val(s), [tensor_val(t) for t in pair]
    if any(v is None or v.dtype != sval.dtype or tuple(v.shape) != tuple(sval.shape) for v in vals):
        return None  # a broadcast or a mixed-dtype add is not a residual add
    return tuple(pair)


# ------------------------------------------------------------------ rewrite
@dataclass
class _Readers:
    """Who keeps reading the norm's values after the rewrite (its own nodes and the site do not)."""

    normed: list  # readers of h in its own shape
    flat: list  # readers of the flattening view the site reads (other than the site)
    summed: list  # readers of s = a + b (the residual stream)

    def all(self, site):
        return [site, *self.normed, *self.flat, *self.summed]


def _readers(match: NormMatch, site, x) -> _Readers:
    skip = set(match.chain) | {site, x}
    flat = [u for u in x.users if u is not site] if x is not match.out else []
    summed = [u for u in match.s.users if u not in skip] if match.residual is not None else []
    return _Readers([u for u in match.out.users if u not in skip], flat, summed)


def _placeable(order, match: NormMatch, site, x) -> bool:
    """The fused op goes right before the first node that reads one of its outputs; its inputs must precede it.

    The weight's cast to the activation dtype may come later (Inductor's decomposition puts it right before the
    multiply): a cast of a tensor defined in time is repeated at the fused op.
    """
    first = min(order[n] for n in _readers(match, site, x).all(site))
    weight = match.weight if order[match.weight] < first else _strip_cast(match.weight)
    return all(order[n] < first for n in (*(match.residual or (match.s,)), weight))


def _rewrite(graph, order, site, x, match: NormMatch) -> None:
    ops = torch.ops.cpgraph
    readers = _readers(match, site, x)
    first = min(readers.all(site), key=order.__getitem__)
    k = tensor_val(match.s).shape[-1]
    emit = bool(readers.normed or readers.flat)
    _, group, pow2 = _site_recipe(site)
    with graph.inserting_before(first):
        weight = match.weight
        if order[weight] > order[first]:  # the cast, repeated in time (_placeable)
            weight = insert_call(graph, weight.target, weight.args, dict(weight.kwargs))
        # The op keeps the leading dims of its input ([..., K]), so no reshape with symbolic sizes is needed.
        x_in, residual = match.residual if match.residual is not None else (match.s, None)
        fused = insert_call(graph, ops.fp8_rms_norm_quantize.default, (x_in, residual, weight, match.eps, group,
                                                                      pow2, emit))
        summed, normed, codes, scales = (insert_call(graph, operator.getitem, (fused, i)) for i in range(4))
        for u in readers.summed:
            u.replace_input_with(match.s, summed)
        for u in readers.normed:
            u.replace_input_with(match.out, normed)
        if readers.flat:
            flat = insert_call(graph, aten.reshape.default, (normed, [-1, k]))
            for u in readers.flat:
                u.replace_input_with(x, flat)
    if is_op(site, _QUANT):
        for user in list(site.users):  # getitem(site, 0 | 1)
            user.replace_all_uses_with(codes if user.args[1] == 0 else scales)
            graph.erase_node(user)
    else:
        _x, w, ws, block_n, block_k, _p = call_args(site, FP8_LINEAR_ARGS)
        with graph.inserting_before(site):
            new = insert_call(graph, ops.fp8_linear_quantized.default,
                              (codes, scales, w, ws, block_n, block_k, tensor_val(site).dtype))
        site.replace_all_uses_with(new)
    graph.erase_node(site)


def _site_recipe(site):
    """``(x, group, pow2)`` the site quantises with."""
    if is_op(site, _QUANT):
        return call_args(site, FP8_QUANTIZE_ARGS)
    x, _w, _ws, _bn, block_k, pow2 = call_args(site, FP8_LINEAR_ARGS)
    return x, block_k, pow2


__all__ = ["fuse_norm_into_quantization", "match_rms_norm", "NormMatch"]
