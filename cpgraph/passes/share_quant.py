"""Quantise an activation once for every FP8 projection that reads it.

Why: ``cpgraph::fp8_block_linear`` quantises its input itself (one full read
of ``x`` and a write of its e4m3 codes per call).  Several projections of the
DSA family read the same activation: the attention's ``q_a`` and ``kv_a`` and
the indexer's ``wk`` all read the normed hidden state, an MLP's ``gate`` and
``up`` read the same rows.  At V3.2's sizes and 4096 rows the quantisation is
26-30 us, about as long as ``kv_a``'s whole FP8 GEMM (36 us, H200), so each
extra pass over the same ``x`` costs the FP8 projections their margin over
bf16 (docs/ops/fp8_linear.md).

Rewrite, for each group of ``fp8_block_linear`` calls on the same ``x`` (the
same node, or views of one node with the same shape and strides) with the
same ``(block_k, act_scale_pow2)`` (two or more calls)::

    y1 = fp8_block_linear(x, w1, s1, bn, bk, p)      q, xs = fp8_quantize_activations(x, bk, p)
    y2 = fp8_block_linear(x, w2, s2, bn, bk, p)  ->  y1 = fp8_linear_quantized(q, xs, w1, s1, bn, bk, dtype)
                                                     y2 = fp8_linear_quantized(q, xs, w2, s2, bn, bk, dtype)

Same codes and scales as each call would have computed (the quantisation is
a function of ``x`` alone), so the result is bit-equal to the unrewritten
graph on every provider.  A single call is left alone (nothing to share).
Finding no FP8 projection is not an error: bf16 models have none.  Runs after
``use_invariant_kernels``, which replaces these calls with their
row-invariant form in deterministic mode (then nothing matches).
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx

from .config import CPConfig
from .fx_utils import FP8_LINEAR_ARGS, VIEW_OPS, call_args, find_nodes, insert_call, is_op
from .graph_facts import order_of, tensor_val

_LINEAR = "cpgraph.fp8_block_linear"


def share_activation_quantization(gm: fx.GraphModule, cfg: CPConfig | None = None) -> fx.GraphModule:
    graph = gm.graph
    groups: dict[tuple, list[fx.Node]] = defaultdict(list)
    for node in find_nodes(graph, _LINEAR):
        x, _w, _s, _bn, block_k, pow2 = _args(node)
        groups[(_same_values(x), block_k, pow2)].append(node)
    order = order_of(graph)
    ops = torch.ops.cpgraph
    for (_, block_k, pow2), linears in groups.items():
        if len(linears) < 2:
            continue
        first = min(linears, key=order.__getitem__)
        x = _args(first)[0]  # defined before the first call, so before the quantisation put in front of it
        val = tensor_val(x)
        dtype = val.dtype if val is not None else first.meta["val"].dtype
        with graph.inserting_before(first):
            quant = insert_call(graph, ops.fp8_quantize_activations.default, (x, block_k, pow2))
            codes = insert_call(graph, operator.getitem, (quant, 0))
            scales = insert_call(graph, operator.getitem, (quant, 1))
        for node in linears:
            _x, w, s, block_n, bk, _p = _args(node)
            with graph.inserting_before(node):
                new = insert_call(graph, ops.fp8_linear_quantized.default, (codes, scales, w, s, block_n, bk, dtype))
            node.replace_all_uses_with(new)
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


def _same_values(x: fx.Node):
    """A key equal for nodes that hold the same values: each projection flattens its input with a view of its
    own (``x.reshape(-1, K)``), so two calls on one activation see two view nodes of one base."""
    base = x
    while is_op(base, *VIEW_OPS) and isinstance(base.args[0], fx.Node):
        base = base.args[0]
    val = tensor_val(x)
    if base is x or val is None:  # no view, or one whose shape is unknown: only the node itself matches
        return (x, None)
    return (base, str(tuple(val.shape)), str(val.stride()))


def _args(node: fx.Node) -> tuple:
    return call_args(node, FP8_LINEAR_ARGS)
