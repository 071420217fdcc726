"""The model and the request the deterministic-mode tests share, and how they read a request's KV bytes.

The model is the two-layer GLM-5-style tiny model of the pass tests (layer 0
dense MLP with its own indexer, layer 1 MoE with a shared IndexCache
indexer), in bf16: every kind of product the forward has (dense linears,
the fp32 router and indexer head weights, the absorbed-query and ``W_UV``
batched products, routed and shared experts, the LM head).

``TARGET`` is the request every test follows: 53 tokens (three full pages
and a partial one), longer than the indexer's top-k (16), so the sparse
attention really selects.  ``OTHERS`` are the requests it shares batches
with.
"""

from __future__ import annotations

import numpy as np
import torch

PAGE = 16


def build(dtype=torch.bfloat16, seed: int = 0):
    from cpgraph.models import DSAConfig, build_model, init_random
    from cpgraph.models.config import bundled_config_dict
    from cpgraph.models.prefill import make_layout

    d = dict(bundled_config_dict("tiny-glm5"), num_hidden_layers=2)
    model = init_random(build_model(DSAConfig.from_hf_dict(d), dtype), seed=seed, std=0.1).eval()
    cfg = model.config
    assert cfg.mlp_layer_types == ("dense", "sparse") and cfg.indexer_types == ("full", "shared")
    model.kv_layout = make_layout(model, "bf16", PAGE)
    return model


def prompts(seed: int = 5) -> tuple[list[int], list[list[int]]]:
    """``(TARGET, OTHERS)``: the followed request and four others of mixed lengths."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 512, (53,), generator=g).tolist()
    others = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 17, 70, 33)]
    return target, others


def eager(model):
    def forward(ids, meta, mla, index, **kw):
        return model(ids, meta, mla, index, **kw)

    return forward


def request_records(model, res, i: int, n_tokens: int) -> list[np.ndarray]:
    """Request ``i``'s KV bytes of a single-device ``run_prefill`` result, by logical position, every pool.

    MLA records of every layer, then index-K rows of every indexer layer;
    ``uint8`` views so a comparison is of bytes, not of values.
    """
    from cpgraph.runtime.engine import pool_tensors

    table = np.asarray(res.tables[i])
    pos = np.arange(n_tokens)
    slots = torch.as_tensor(table[pos // PAGE] * PAGE + pos % PAGE)
    mla, index = pool_tensors(res.pool, model)
    return [p[slots].contiguous().view(torch.uint8).numpy().copy() for p in mla + index]


class SeenRecords:
    """A forward wrapper keeping the KV bytes of every position the last pass attended over, in position order.

    For a pass of one request: its cached-prefix slots (``prefix_slots``)
    then its extend rows' slots; read right after the forward, every pool
    (MLA layers, then index-K layers).  How a cache-engine run's KV bytes are
    read (its pages belong to the radix tree, not to a result table).
    """

    def __init__(self, forward, model):
        self.forward, self.model, self.records = forward, model, None

    def __call__(self, ids, meta, mla, index, **kw):
        out = self.forward(ids, meta, mla, index, **kw)
        prefix = meta.prefix_slots[meta.prefix_slots >= 0]
        live = meta.row_slots >= 0
        order = torch.argsort(meta.positions[live])
        slots = torch.cat([prefix, meta.row_slots[live][order]])
        self.records = [p[slots].contiguous().view(torch.uint8).numpy().copy() for p in list(mla) + list(index)]
        return out


def same_records(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


def owned_page_records(model, res, i: int, n_tokens: int) -> dict[int, list[np.ndarray]]:
    """Request ``i``'s KV bytes on this CP rank: ``{logical page: [bytes of its valid rows, every pool]}``.

    A rank's table holds ``-1`` for the pages another rank owns; the pages of
    all ranks together cover the request once.
    """
    from cpgraph.runtime.engine import pool_tensors

    table = np.asarray(res.tables[i])
    mla, index = pool_tensors(res.pool, model)
    out = {}
    for page in np.flatnonzero(table >= 0):
        rows = min(PAGE, n_tokens - int(page) * PAGE)
        slots = torch.arange(rows) + int(table[page]) * PAGE
        out[int(page)] = [p[slots].contiguous().view(torch.uint8).numpy().copy() for p in mla + index]
    return out


def page_records(records: list[np.ndarray], page: int) -> list[np.ndarray]:
    """The rows of logical page ``page`` out of :func:`request_records`' per-position bytes."""
    return [r[page * PAGE : (page + 1) * PAGE] for r in records]
