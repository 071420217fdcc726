"""Single-device attention pass: sparse MLA reads the KV pool where it lives.

The model builds each layer's full KV view with ``kv_compose`` (cached
prefix rows gathered from the pool + this forward's fresh records) and hands
sparse MLA RAGGED ids into that view.  That form is what CP needs (an
owner-sharded pool does not hold the other ranks' pages, so the view must be
materialised).  On ONE device the pool holds every page a row can select:
cached prefix pages are local (HiCache load-back finishes before
``kv_layer_ready`` returns) and this forward's records were stored before
attention reads, so the view is a copy of pool rows that is written, read
once and dropped, per layer; with FP8 records it is also unpacked to 576
floats per token only for 2048 keys per row to be used.  This pass removes
that copy: sparse MLA reads the pool by PAGED slot ids.

Before (one layer)::

    rec = mla_dense_pack(c, k_pe)              # or mla_fp8_pack
    pool1 = paged_store(pool0, rec, slots)
    kv, = kv_compose([paged_gather(pool1, prefix_slots)], [rec], kv_source)
    kv = mla_fp8_unpack(kv, dtype)             # FP8 records only
    pool2 = kv_layer_written(pool1)
    out, lse = sparse_mla(q, kv, topk, scale, d_v)

After::

    rec = mla_dense_pack(c, k_pe)
    pool1 = paged_store(pool0, rec, slots)
    pool2 = kv_layer_written(pool1)
    kv_slots = lookup(cat(prefix_slots, slots), kv_source)   # once per batch: full-view row -> slot
    paged = lookup(kv_slots, topk)                            # once per distinct top-k
    out, lse = sparse_mla(q, pool2, paged, scale, d_v)        # bf16 records
    out, lse = sparse_mla_fp8(q, pool2, paged, scale, d_v)    # 656-byte FP8 records

``lookup(table, ids)`` is ``table[ids]`` with the index rule of the row ops
(an id outside ``[0, len(table))``, ``-1`` included, gives slot ``-1``,
which sparse MLA skips), written as fusable aten ops whose every index is
in range by construction.  The pool value read is the one current at the
attention call (after ``kv_layer_written``), so Inductor still writes the
pool in place.

Decision rule (static facts only, identical on every rank): the pass
rewrites iff ``cfg.cp_size == 1``; a layer of FP8 records only with
``cfg.fp8_records_in_place``.  By default an FP8 layer keeps its view: the
unpack runs at copy rate (1.8 KB per key, once per layer) and lets the bf16
provider (FlashMLA, 3.3x the Triton FP8 kernel's rate at V3.2's sizes)
attend, which is worth far more than the copy it costs.  Under CP the pool is owner-sharded and
the materialised view stays the input (``materialize_kv_by_owner``).  A
``sparse_mla`` whose keys come from a ``kv_compose`` must match completely
(prefix rows gathered from the same pool, current rows stored into that
pool before the attention call); anything else raises
:class:`PassMatchError` rather than silently keeping the copy.  A
``sparse_mla`` whose keys do not come from a ``kv_compose`` is not a
materialised view and is left alone.  See ``docs/passes.md``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .cleanup import sort_topologically
from .config import CPConfig
from .fx_utils import find_nodes, insert_call, is_op
from .graph_facts import PassMatchError, order_of, tensor_val, version_at, version_history

aten = torch.ops.aten
prims = torch.ops.prims

# Ops that declare the pool mutated only to mark a point in program order (no bytes change).
_EVENTS = ("cpgraph.kv_layer_ready", "cpgraph.kv_layer_written")


def _length(graph: fx.Graph, node: fx.Node):
    """``node``'s first dim: an int, or an ``aten.sym_size`` node when it is symbolic."""
    n = tensor_val(node).shape[0]
    if isinstance(n, int):
        return n
    return insert_call(graph, aten.sym_size.int, (node, 0))


def _as_dtype(graph: fx.Graph, node: fx.Node, dtype: torch.dtype) -> fx.Node:
    if tensor_val(node).dtype == dtype:
        return node
    return insert_call(graph, prims.convert_element_type.default, (node, dtype))


def _lookup(graph: fx.Graph, table: fx.Node, ids: fx.Node) -> fx.Node:
    """``table[ids]``, ``-1`` where an id is outside ``[0, len(table))``; every read in range."""
    n = _length(graph, table)
    ok = insert_call(
        graph,
        aten.bitwise_and.Tensor,
        (insert_call(graph, aten.ge.Scalar, (ids, 0)), insert_call(graph, aten.lt.Scalar, (ids, n))),
    )
    # Row 0 of the padded table is the -1 sentinel, so a miss reads a real row too.
    pos = insert_call(graph, aten.where.ScalarOther, (ok, insert_call(graph, aten.add.Tensor, (ids, 1)), 0))
    padded = insert_call(graph, aten.constant_pad_nd.default, (table, [1, 0], -1))
    return insert_call(graph, aten.index.Tensor, (padded, [pos]))


class _Layer:
    """The matched materialisation behind one ``sparse_mla`` call."""

    def __init__(self, attn: fx.Node, order: dict[fx.Node, int]):
        self.attn = attn
        kv = attn.args[1]
        self.unpack = None
        if isinstance(kv, fx.Node) and is_op(kv, "cpgraph.mla_fp8_unpack"):
            self.unpack, kv = kv, kv.args[0]
        self.view = kv
        compose = kv.args[0] if isinstance(kv, fx.Node) and kv.target is operator.getitem else None
        self.compose = compose if compose is not None and is_op(compose, "cpgraph.kv_compose") else None
        if self.compose is None:
            return
        if len(attn.args) != 5 or attn.kwargs:
            raise PassMatchError(f"{attn.name} does not take (q, kv, idx, sm_scale, d_v) positionally",
                                 rule="materialised-view", nodes=[attn])
        k = kv.args[1]
        prefix_rows, current_rows, self.kv_source = self.compose.args[:3]
        self.gather, current = prefix_rows[k], current_rows[k]
        if not (isinstance(self.gather, fx.Node) and is_op(self.gather, "cpgraph.paged_gather")):
            raise PassMatchError(
                f"the KV of {attn.name} is composed from prefix rows {self.gather} that are not a paged_gather "
                "of a pool; cannot read it in place", rule="materialised-view", nodes=[attn, self.compose])
        pool_value, self.prefix_slots = self.gather.args[:2]
        self.pool = version_at(pool_value, attn, order)
        history = version_history(self.pool)
        stores = [m for m in history if is_op(m, "cpgraph.paged_store") and m.kwargs.get("rows") is current]
        if not stores:
            raise PassMatchError(
                f"this forward's KV rows {current.name} are not stored into the pool {pool_value.name} read by "
                f"{self.gather.name} before {attn.name}; reading the pool in place would miss them",
                rule="materialised-view", nodes=[attn, current])
        # Between the prefix gather and the attention the pool may only gain these rows
        # (events change no bytes); any other write would make the pool differ from the view.
        for m in history[len(version_history(pool_value)):]:
            if m not in stores and not is_op(m, *_EVENTS):
                raise PassMatchError(
                    f"{m.name} writes the pool of {attn.name} between its prefix gather and the attention",
                    rule="materialised-view", nodes=[m, attn])
        self.slots = stores[-1].kwargs["slots"]
        self.records_fp8 = tensor_val(self.pool).dtype == torch.uint8
        if self.records_fp8 != (self.unpack is not None):
            raise PassMatchError(
                f"{attn.name} reads {'unpacked FP8' if self.unpack is not None else 'dense'} KV but its pool "
                f"{self.pool.name} holds {tensor_val(self.pool).dtype} records", rule="materialised-view",
                nodes=[attn, self.pool])


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    for node in nodes:
        if node is not None and node.graph is graph and not node.users:
            graph.erase_node(node)


def read_kv_in_place(gm: fx.GraphModule, cfg: CPConfig) -> fx.GraphModule:
    """On one device, point every ``sparse_mla`` at the KV pool with PAGED ids (module docstring)."""
    if cfg.cp_size > 1:
        return gm  # owner-sharded pool: the materialised view stays the attention input
    graph = gm.graph
    order = order_of(graph)
    layers = [layer for layer in (_Layer(a, order) for a in find_nodes(graph, "cpgraph.sparse_mla"))
              if layer.compose and (cfg.fp8_records_in_place or not layer.records_fp8)]
    slot_maps: dict[tuple, fx.Node] = {}
    paged_ids: dict[tuple, fx.Node] = {}
    for layer in layers:
        attn = layer.attn
        with graph.inserting_before(attn):
            key = (layer.prefix_slots, layer.slots, layer.kv_source)
            if key not in slot_maps:
                table = insert_call(
                    graph,
                    aten.cat.default,
                    ([_as_dtype(graph, layer.prefix_slots, torch.int64), _as_dtype(graph, layer.slots, torch.int64)],),
                )
                # Slot ids fit int32 (a pool has < 2**31 slots): halves the [M, topk] id list.
                slot_maps[key] = _as_dtype(graph, _lookup(graph, table, layer.kv_source), torch.int32)
            kv_slots = slot_maps[key]
            ids = attn.args[2]
            if (ids, kv_slots) not in paged_ids:
                paged_ids[(ids, kv_slots)] = _lookup(graph, kv_slots, ids)
            q, _, _, scale, d_v = attn.args
            op = torch.ops.cpgraph.sparse_mla_fp8.default if layer.records_fp8 else torch.ops.cpgraph.sparse_mla.default
            new = insert_call(graph, op, (q, layer.pool, paged_ids[(ids, kv_slots)], scale, d_v))
        attn.replace_all_uses_with(new)
        graph.erase_node(attn)
        _erase_dead(graph, [layer.unpack, layer.view])
        _erase_dead(graph, [layer.compose])
        _erase_dead(graph, [layer.gather])
    return sort_topologically(gm)
