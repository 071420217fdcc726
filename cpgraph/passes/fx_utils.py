"""Small FX helpers shared by the passes: naming, counting, inserting, printing.

Inserted nodes get ``meta["val"]`` (a fake tensor computed from the inputs'
fake values) and nothing else: copying other meta onto new nodes breaks
Inductor lowering.  See ``docs/passes.md`` for the invariants.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2
from torch.utils._pytree import tree_map

_AUTO_FUNC = (auto_functionalized, auto_functionalized_v2)


def op_of(node: fx.Node):
    """The op a call_function node runs; unwraps auto_functionalized(op, ...)."""
    if node.op != "call_function":
        return None
    if node.target in _AUTO_FUNC:
        return node.args[0]
    return node.target


def op_name(target) -> str:
    """``cpgraph.paged_store`` / ``aten.mm`` / ``_c10d_functional.wait_tensor`` / python name."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"{target._qualified_op_name.replace('::', '.')}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    return getattr(target, "__name__", str(target))


def is_op(node: fx.Node, *names: str) -> bool:
    op = op_of(node)
    return op is not None and op_name(op) in names


# Ops that only reinterpret a tensor's shape (what a flattening ``x.reshape(-1, K)`` becomes in an ATen graph).
VIEW_OPS = ("aten.view", "aten.reshape", "aten._unsafe_view")

FP8_LINEAR_ARGS = ("x", "weight", "weight_scale_inv", "block_n", "block_k", "act_scale_pow2")
FP8_QUANTIZE_ARGS = ("x", "group", "pow2")


def call_args(node: fx.Node, names: tuple[str, ...]) -> tuple:
    """``node``'s arguments in schema order ``names``, whether passed by position or by keyword."""
    return tuple(list(node.args) + [node.kwargs[n] for n in names[len(node.args):]])


def find_nodes(graph: fx.Graph, *names: str) -> list[fx.Node]:
    return [n for n in graph.nodes if is_op(n, *names)]


def op_counts(graph: fx.Graph, prefix: str | None = None) -> Counter:
    """How many nodes run each op (auto_functionalized counted as the op it wraps)."""
    c: Counter = Counter()
    for n in graph.nodes:
        op = op_of(n)
        if op is None or op is operator.getitem:  # tuple unpacking is bookkeeping, not an op
            continue
        name = op_name(op)
        if prefix is None or name.startswith(prefix):
            c[name] += 1
    return c


def fake_mode_of(graph: fx.Graph):
    for n in graph.nodes:
        v = n.meta.get("val")
        for t in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(t, torch._subclasses.FakeTensor):
                return t.fake_mode
    return None


def _meta_val(a: Any):
    return a.meta["val"] if isinstance(a, fx.Node) else a


def insert_call(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """Create ``target(*args)`` at the graph's current insert point with ``meta["val"]`` set."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    mode = fake_mode_of(graph)
    if mode is not None:
        fargs = tree_map(_meta_val, args)
        fkwargs = tree_map(_meta_val, kwargs)
        with mode:
            node.meta["val"] = target(*fargs, **fkwargs)
    return node


def _fmt(a: Any, names: dict) -> str:
    if isinstance(a, fx.Node):
        return names.get(a, a.name)
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt(x, names) for x in a)
        return f"[{inner}]"
    if isinstance(a, torch.dtype):
        return str(a).replace("torch.", "")
    if isinstance(a, float):
        return f"{a:.6g}"
    if isinstance(a, (torch.SymInt, torch.SymFloat)):
        return "s"
    return repr(a)


def normalized_graph(graph: fx.Graph, keep: Iterable[str] | None = None) -> str:
    """A stable text form of a graph for snapshots.

    Nodes are renamed in order (``in0`` for inputs, ``v0`` for values), and
    only ops whose name starts with one of ``keep`` are printed (all if None),
    with references to omitted nodes shown as ``_``.  Shapes are left out so
    the snapshot does not depend on the example sizes.
    """
    keep = tuple(keep) if keep is not None else None
    names: dict = {}
    lines = []
    n_in = n_v = 0
    for n in graph.nodes:
        if n.op == "placeholder":
            names[n] = f"in{n_in}"
            n_in += 1
            continue
        if n.op == "output":
            continue
        op = op_of(n)
        if op is None:
            continue
        name = op_name(op)
        if keep is not None and not name.startswith(keep):
            if op is operator.getitem and n.args[0] in names:  # an output of a shown multi-output op
                names[n] = f"{names[n.args[0]]}[{n.args[1]}]"
            continue
        names[n] = f"v{n_v}"
        n_v += 1
        args = n.args[1:] if n.target in _AUTO_FUNC else n.args
        shown = []
        for a in args:
            if isinstance(a, fx.Node) and a not in names:
                shown.append("_")
            else:
                shown.append(_fmt(a, names))
        if n.target in _AUTO_FUNC:
            shown += [f"{k}={_fmt(v, names) if not isinstance(v, fx.Node) or v in names else '_'}" for k, v in n.kwargs.items() if not k.startswith("_")]
        lines.append(f"{names[n]} = {name}({', '.join(shown)})")
    return "\n".join(lines)
