"""The prefill engine: plan, allocate owned pages, build the batch, run the forward.

One code path serves a single device (``cp_size == 1``, the eager model or a
compiled one) and every rank of a CP group (the model compiled with the CP
passes).  Per call:

1. validate the prompts and cached-prefix lengths (page multiples) with
   :func:`cpgraph.runtime.inputs.check_prompts`, the check the CLI runs
   before spawning ranks;
2. plan the prefix pass (prompts' cached prefixes, computed first) and the
   extend pass with :func:`cpgraph.plan.plan_prefill`; every rank derives
   the same plans and therefore the same page owners;
3. allocate each request's pages in ONE ``alloc_pages_with_owners`` call
   (prefix pages keep the owners that computed them; extend pages get the
   extend plan's owners), so a rank's pool holds exactly the pages it owns;
4. run the prefix pass (if any prefix) and the extend pass through
   ``forward``; the extend pass reads the prefix from the owners' pools.

``forward`` is called as ``forward(input_ids, meta, mla_pools, index_pools)``
and returns the model's :class:`~cpgraph.models.model.ForwardOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from cpgraph.plan import plan_prefill

from .inputs import check_prompts  # the transfer driver and cache engine import it from here too
from .kv_pool import KVPool, KVPoolConfig

_FORMATS = {"bf16": "dense", "dense": "dense", "fp8": "fp8"}


@dataclass
class EngineResult:
    logits: Tensor  # fp32 [B, vocab] last-token logits (identical on every rank)
    kv_bytes: int  # bytes of the KV pages this rank holds (MLA + index-K, all layers)
    pages_owned: int  # pages this rank holds
    total_pages: int  # pages of the whole batch (what a replicated cache would hold on every rank)
    bytes_per_page: int
    pool_bytes: int = 0  # bytes this rank's pool allocated (== kv_bytes: the pool holds only owned pages)
    topk: list[Tensor] | None = None
    meta: object | None = None  # extend pass BatchMeta


def weight_bytes_per_rank(model) -> int:
    """Bytes of the weights this rank holds: parameters and buffers, a tied tensor once.

    Under expert parallelism the routed experts count only the local shard
    (``E / ep`` experts), so this is the weight share of the rank's device
    memory, the figure to print next to :attr:`EngineResult.kv_bytes`.
    ``cpgraph.plan.memory.weight_bytes`` predicts it from a config alone.
    """
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def pool_config(model, kv_format: str, page_size: int, num_pages: int, rank: int = 0) -> KVPoolConfig:
    cfg = model.config
    return KVPoolConfig(
        num_layers=cfg.num_hidden_layers,
        page_size=page_size,
        num_pages=num_pages,
        kv_format=_FORMATS[kv_format],
        kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_dim=cfg.qk_rope_head_dim,
        index_head_dim=cfg.index_head_dim,
        index_layers=list(cfg.indexer_layers),
        dtype=model.dtype,
        device=model.device,
        rank=rank,
    )


def pool_tensors(pool: KVPool, model) -> tuple[list[Tensor], list[Tensor]]:
    """``(mla_pools, index_pools)`` in the order the model's forward takes them."""
    cfg = model.config
    return [pool.mla_pool(i) for i in range(cfg.num_hidden_layers)], [pool.index_pool(i) for i in cfg.indexer_layers]


def forward_batch(forward: Callable, plan, tokens, tables, prefix_owners, pools, device, *, rank: int = 0,
                  return_topk: bool = False):
    """Build one planned batch (``build_batch``) and run ``forward`` on it; returns ``(output, meta)``.

    ``tokens[i]``: request i's extend tokens; ``tables[i]``: this rank's page
    per logical page (cached prefix, then extend; ``-1`` foreign);
    ``prefix_owners[i]``: owner rank of each cached prefix page; ``pools``:
    ``(mla_pools, index_pools)``.  Shared by :func:`run_prefill` and the
    cache-aware engine (:mod:`cpgraph.runtime.cache_engine`).
    """
    from cpgraph.models.batch import build_batch

    mla, index = pools
    ids, meta = build_batch(plan, tokens, tables, device, rank=rank, prefix_page_owners=prefix_owners)
    out = forward(ids, meta, mla, index, return_topk=return_topk) if return_topk else forward(ids, meta, mla, index)
    return out, meta


@torch.no_grad()
def run_prefill(
    forward: Callable,
    model,
    token_lists: Sequence[Sequence[int]],
    *,
    prefix_lens: Sequence[int] | None = None,
    kv_format: str = "bf16",
    page_size: int = 16,
    rank: int = 0,
    cp_size: int = 1,
    return_topk: bool = False,
    progress: Callable[[str], None] | None = None,
) -> EngineResult:
    """Prefill ``token_lists`` as rank ``rank`` of a CP group of ``cp_size`` (see module docstring)."""
    if kv_format not in _FORMATS:
        raise ValueError(f"kv_format must be 'bf16' or 'fp8', got {kv_format!r}")
    lists, prefix = check_prompts(token_lists, prefix_lens, page_size, model.config.vocab_size)
    B = len(lists)
    extend = [len(t) - p for t, p in zip(lists, prefix)]
    with_prefix = [i for i in range(B) if prefix[i] > 0]
    pre_plan = None
    if with_prefix:
        pre_plan = plan_prefill([0] * len(with_prefix), [prefix[i] for i in with_prefix], cp_size=cp_size,
                                page_size=page_size)
    ext_plan = plan_prefill(prefix, extend, cp_size=cp_size, page_size=page_size)

    # Owners of every page of every request: prefix pages as the prefix pass computed them.
    prefix_owners = [[] for _ in range(B)]
    for j, i in enumerate(with_prefix):
        prefix_owners[i] = pre_plan.page_owners(j)
    owners = [prefix_owners[i] + ext_plan.page_owners(i) for i in range(B)]
    total_pages = sum(len(o) for o in owners)
    owned = sum(o.count(rank) for o in owners)
    pool = KVPool(pool_config(model, kv_format, page_size, owned, rank))
    tables = [pool.alloc_pages_with_owners(o) for o in owners]
    pools = pool_tensors(pool, model)
    device = model.device

    if pre_plan is not None:
        if progress:
            progress(f"prefix pass: {len(with_prefix)} request(s), {sum(prefix)} token(s)")
        forward_batch(forward, pre_plan, [lists[i][: prefix[i]] for i in with_prefix],
                      [tables[i][: len(prefix_owners[i])] for i in with_prefix], [[] for _ in with_prefix], pools,
                      device, rank=rank)

    if progress:
        progress(f"extend pass: {B} request(s), {sum(extend)} token(s)")
    out, meta = forward_batch(forward, ext_plan, [t[p:] for t, p in zip(lists, prefix)], tables, prefix_owners, pools,
                              device, rank=rank, return_topk=return_topk)
    return EngineResult(
        logits=out.logits,
        kv_bytes=owned * pool.bytes_per_page(),
        pages_owned=owned,
        total_pages=total_pages,
        bytes_per_page=pool.bytes_per_page(),
        pool_bytes=pool.total_bytes(),
        topk=out.topk,
        meta=meta if return_topk else None,
    )
