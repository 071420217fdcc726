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

With a ``draft`` forward (the MTP layer, docs/mtp.md) every pass also runs
the draft right after the target, on the target's CP-local hidden rows, and
the pool holds one more logical layer (id ``num_hidden_layers``) for it.
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
    draft_logits: Tensor | None = None  # fp32 [B, vocab]: the MTP draft's logits (with a draft forward)
    sampled: Tensor | None = None  # int64 [B]: the token the draft was given as each request's next token
    pool: object | None = None  # this rank's KVPool (kept for callers that read pages, e.g. transfer tests)
    tables: list | None = None  # this rank's page table per request (cached prefix, then extend pages)


def weight_bytes_per_rank(model) -> int:
    """Bytes of the weights this rank holds: parameters and buffers, a tied tensor once.

    Under expert parallelism the routed experts count only the local shard
    (``E / ep`` experts), so this is the weight share of the rank's device
    memory, the figure to print next to :attr:`EngineResult.kv_bytes`.
    ``cpgraph.plan.memory.weight_bytes`` predicts it from a config alone.
    """
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def pool_layers(model, draft: bool = False) -> tuple[int, list[int]]:
    """``(num_layers, index_layers)`` of the pool: the target's, plus the draft layer when ``draft``."""
    cfg = model.config
    if not draft:
        return cfg.num_hidden_layers, list(cfg.indexer_layers)
    return cfg.num_hidden_layers + 1, list(cfg.indexer_layers) + [cfg.draft_layer]


def pool_config(model, kv_format: str, page_size: int, num_pages: int, rank: int = 0, *,
                draft: bool = False) -> KVPoolConfig:
    cfg = model.config
    num_layers, index_layers = pool_layers(model, draft)
    return KVPoolConfig(
        num_layers=num_layers,
        page_size=page_size,
        num_pages=num_pages,
        kv_format=_FORMATS[kv_format],
        kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_dim=cfg.qk_rope_head_dim,
        index_head_dim=cfg.index_head_dim,
        index_layers=index_layers,
        dtype=model.dtype,
        device=model.device,
        rank=rank,
    )


def pool_tensors(pool: KVPool, model) -> tuple[list[Tensor], list[Tensor]]:
    """``(mla_pools, index_pools)`` in the order the model's forward takes them."""
    cfg = model.config
    return [pool.mla_pool(i) for i in range(cfg.num_hidden_layers)], [pool.index_pool(i) for i in cfg.indexer_layers]


def draft_pools(pool: KVPool, model) -> tuple[Tensor, Tensor]:
    """``(mla_pool, index_pool)`` of the draft layer (logical layer ``num_hidden_layers``)."""
    layer = model.config.draft_layer
    return pool.mla_pool(layer), pool.index_pool(layer)


def forward_batch(forward: Callable, plan, tokens, tables, prefix_owners, pools, device, *, rank: int = 0,
                  return_topk: bool = False, draft: Callable | None = None, draft_pools=None, prompts=None,
                  sampled: Tensor | None = None):
    """Build one planned batch (``build_batch``) and run ``forward`` on it; returns ``(output, meta)``.

    ``tokens[i]``: request i's extend tokens; ``tables[i]``: this rank's page
    per logical page (cached prefix, then extend; ``-1`` foreign);
    ``prefix_owners[i]``: owner rank of each cached prefix page; ``pools``:
    ``(mla_pools, index_pools)``.  Shared by :func:`run_prefill` and the
    cache-aware engine (:mod:`cpgraph.runtime.cache_engine`).

    ``draft``: the MTP draft forward; it then runs on the target's local
    hidden rows with ``draft_pools`` (its layer's pools), taking each row's
    next token from ``prompts`` (whole token lists) and, for a request's last
    prompt row, from ``sampled`` (default: the target's greedy token; a
    callable is called with the target's output and returns the ``[B]`` ids).
    Returns ``(output, meta, draft_output, sampled)`` then.
    """
    from cpgraph.models.batch import build_batch, build_draft_inputs

    mla, index = pools
    ids, meta = build_batch(plan, tokens, tables, device, rank=rank, prefix_page_owners=prefix_owners)
    kw = {"return_topk": True} if return_topk else {}
    if draft is None:
        return forward(ids, meta, mla, index, **kw), meta
    out = forward(ids, meta, mla, index, return_local_hidden=True, **kw)
    if callable(sampled):  # chosen from the target's output (the serving engine's sampling, on every rank)
        sampled = sampled(out)
    elif sampled is None:
        sampled = out.logits.argmax(-1)  # every rank holds the same logits, so the same tokens
    dinputs = build_draft_inputs(plan, prompts, sampled, device, rank=rank)
    dout = draft(out.local_hidden, dinputs, meta, *draft_pools)
    return out, meta, dout, dinputs.sampled


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
    draft: Callable | None = None,
    draft_tokens: Sequence[int] | None = None,
) -> EngineResult:
    """Prefill ``token_lists`` as rank ``rank`` of a CP group of ``cp_size`` (see module docstring).

    ``draft``: the MTP draft forward (``DraftModel`` or its compiled form),
    run after the target in both passes; ``draft_tokens``: each request's
    sampled next token for the draft (default: the target's greedy token).
    """
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
    pool = KVPool(pool_config(model, kv_format, page_size, owned, rank, draft=draft is not None))
    tables = [pool.alloc_pages_with_owners(o) for o in owners]
    pools = pool_tensors(pool, model)
    device = model.device
    dkw = {}
    if draft is not None:
        sampled = None
        if draft_tokens is not None:
            if len(draft_tokens) != B:
                raise ValueError(f"draft_tokens must hold one token per prompt ({B}), got {len(draft_tokens)}")
            sampled = torch.as_tensor(list(draft_tokens), dtype=torch.int64, device=device)
        dkw = dict(draft=draft, draft_pools=draft_pools(pool, model), sampled=sampled)

    if pre_plan is not None:
        if progress:
            progress(f"prefix pass: {len(with_prefix)} request(s), {sum(prefix)} token(s)")
        pre_kw = dict(dkw, prompts=[lists[i] for i in with_prefix], sampled=None) if draft is not None else {}
        forward_batch(forward, pre_plan, [lists[i][: prefix[i]] for i in with_prefix],
                      [tables[i][: len(prefix_owners[i])] for i in with_prefix], [[] for _ in with_prefix], pools,
                      device, rank=rank, **pre_kw)

    if progress:
        progress(f"extend pass: {B} request(s), {sum(extend)} token(s)")
    res = forward_batch(forward, ext_plan, [t[p:] for t, p in zip(lists, prefix)], tables, prefix_owners, pools,
                        device, rank=rank, return_topk=return_topk, **(dict(dkw, prompts=lists) if draft else {}))
    out, meta = res[0], res[1]
    return EngineResult(
        logits=out.logits,
        kv_bytes=owned * pool.bytes_per_page(),
        pages_owned=owned,
        total_pages=total_pages,
        bytes_per_page=pool.bytes_per_page(),
        pool_bytes=pool.total_bytes(),
        topk=out.topk,
        meta=meta if return_topk else None,
        draft_logits=res[2].logits if draft is not None else None,
        sampled=res[3] if draft is not None else None,
        pool=pool,
        tables=tables,
    )
