"""A prefill driver that keeps the pool and page tables and sends each chunk.

``cpgraph.runtime.engine.run_prefill`` builds and drops its pool inside one
call; transfer needs the pool, the page tables and a point between passes,
so this driver runs the same steps (``check_prompts``, ``plan_prefill``,
one owner-lane allocation per pass, ``build_batch``) over a list of passes:

* pass 0 (if any ``prefix_lens``): the cached prefix, computed as
  run_prefill's prefix pass does -- it stands for a radix hit, so nothing is
  sent for it on its own;
* then chunk passes of ``chunk_tokens`` (a page multiple) per request, each
  an extend over everything before it.

Each request's transfer chunk k covers logical pages
``[start // page_size, ceil(end / page_size))`` (absolute), the first
transferred chunk of a request also covers its cached prefix pages (they are
final before the forward starts), and the last chunk carries the aux record.

With a ``draft`` forward (the MTP layer, docs/mtp.md) the pool holds one
more logical layer, id ``num_hidden_layers``; each pass runs the draft right
after the target, before the chunk is finished, so the draft's pages travel
with the chunk like any other layer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from cpgraph.plan import plan_prefill
from cpgraph.runtime.engine import check_prompts, draft_pools, pool_config
from cpgraph.runtime.kv_pool import KVPool


@dataclass
class Pass:
    requests: list[int]
    starts: list[int]
    ends: list[int]
    cached: bool  # a cached-prefix pass (no transfer of its own)


@dataclass
class DriverResult:
    logits: dict[int, torch.Tensor]  # request -> fp32 [vocab] last-token logits
    pool: KVPool
    tables: list[list[int]]
    owners: list[list[int]]
    statuses: dict[int, int] = field(default_factory=dict)
    forward_seconds: float = 0.0
    draft_logits: dict[int, torch.Tensor] = field(default_factory=dict)  # request -> the draft's fp32 [vocab]


def schedule(lens: Sequence[int], prefix: Sequence[int], chunk_tokens: int | None) -> list[Pass]:
    passes = []
    hit = [i for i, p in enumerate(prefix) if p > 0]
    if hit:
        passes.append(Pass(hit, [0] * len(hit), [prefix[i] for i in hit], True))
    pos = list(prefix)
    while True:
        reqs = [i for i in range(len(lens)) if pos[i] < lens[i]]
        if not reqs:
            return passes
        ends = [lens[i] if chunk_tokens is None else min(lens[i], pos[i] + chunk_tokens) for i in reqs]
        passes.append(Pass(reqs, [pos[i] for i in reqs], ends, False))
        for i, e in zip(reqs, ends):
            pos[i] = e


def plan_passes(token_lists, prefix_lens, chunk_tokens, page_size: int, cp_size: int, vocab: int):
    """``(lists, passes, plans, new_owners, owners)``: identical on every rank (no communication)."""
    lists, prefix = check_prompts(token_lists, prefix_lens, page_size, vocab)
    if chunk_tokens is not None and (chunk_tokens < 1 or chunk_tokens % page_size):
        raise ValueError(f"chunk_tokens must be a positive multiple of the page size {page_size}, got {chunk_tokens}")
    passes = schedule([len(t) for t in lists], prefix, chunk_tokens)
    plans = [plan_prefill(p.starts, [e - s for s, e in zip(p.starts, p.ends)], cp_size=cp_size, page_size=page_size)
             for p in passes]
    owners: list[list[int]] = [[] for _ in lists]
    new_owners = []
    for p, plan in zip(passes, plans):
        new_owners.append([plan.page_owners(j) for j in range(len(p.requests))])
        for j, i in enumerate(p.requests):
            owners[i] += new_owners[-1][j]
    return lists, passes, plans, new_owners, owners


def make_pool(model, token_lists, *, prefix_lens=None, chunk_tokens=None, kv_format="bf16", page_size=16,
              rank=0, cp_size=1, spare_pages: int = 0, draft: bool = False) -> KVPool:
    """A pool for rank ``rank`` holding exactly its owned pages of the batch (plus ``spare_pages``).

    ``draft``: with the MTP draft layer's storage (layer ``num_hidden_layers``).
    """
    *_, owners = plan_passes(token_lists, prefix_lens, chunk_tokens, page_size, cp_size, model.config.vocab_size)
    owned = sum(o.count(rank) for o in owners)
    return KVPool(pool_config(model, kv_format, page_size, owned + spare_pages, rank, draft=draft))


@torch.no_grad()
def prefill_and_send(forward: Callable, model, token_lists, *, prefix_lens=None, chunk_tokens: int | None = None,
                     kv_format: str = "bf16", page_size: int = 16, rank: int = 0, cp_size: int = 1,
                     pool: KVPool | None = None, peer=None, rooms: Sequence[int] | None = None,
                     overlap: bool = True, register_timeout: float = 10.0,
                     on_pass: Callable | None = None, draft: Callable | None = None) -> DriverResult:
    """Prefill as rank ``rank``; with ``peer`` (a :class:`PrefillPeer` over ``pool``) send each chunk of ``rooms[i]``.

    ``draft``: the MTP draft forward, run after the target in every pass on
    its CP-local hidden rows (``forward`` is then called with
    ``return_local_hidden=True``); the pool must hold the draft layer.
    """
    import time

    from cpgraph.models.batch import build_batch, build_draft_inputs

    lists, passes, plans, new_owners, owners = plan_passes(token_lists, prefix_lens, chunk_tokens, page_size,
                                                           cp_size, model.config.vocab_size)
    B = len(lists)
    if pool is None:
        pool = KVPool(pool_config(model, kv_format, page_size, sum(o.count(rank) for o in owners), rank,
                                  draft=draft is not None))
    if peer is not None and peer.pool is not pool:
        raise ValueError("peer must be built over the pool the driver writes")
    N = model.config.num_hidden_layers
    if draft is not None and pool.config.num_layers != N + 1:
        raise ValueError(f"a draft forward needs a pool with the draft layer ({N + 1} layers), got "
                         f"{pool.config.num_layers}: build it with make_pool(..., draft=True)")
    tables: list[list[int]] = [[] for _ in range(B)]
    mla = pool.mla[:N]
    index = [pool.index_pool(i) for i in model.config.indexer_layers]
    result = DriverResult({}, pool, tables, owners)
    sent_once = [False] * B
    for p, plan, fresh in zip(passes, plans, new_owners):
        for j, i in enumerate(p.requests):
            tables[i] += pool.alloc_pages_with_owners(fresh[j])
        ids, meta = build_batch(plan, [lists[i][s:e] for i, s, e in zip(p.requests, p.starts, p.ends)],
                                [tables[i] for i in p.requests], model.device, rank=rank,
                                prefix_page_owners=[owners[i][: s // page_size] for i, s in zip(p.requests, p.starts)])
        chunks = []
        if peer is not None and not p.cached:
            for i, s, e in zip(p.requests, p.starts, p.ends):
                room = rooms[i]
                if not peer.wait_registered(room, register_timeout):
                    continue  # never write into pages decode may have reused
                first = 0 if not sent_once[i] else s // page_size
                sent_once[i] = True
                chunks.append((i, e, peer.begin_chunk(room, tables[i], first, -(-e // page_size),
                                                      last=e == len(lists[i]), overlap=overlap)))
        t0 = time.perf_counter()
        if draft is None:
            out = forward(ids, meta, mla, index)
        else:
            out = forward(ids, meta, mla, index, return_local_hidden=True)
            dinputs = build_draft_inputs(plan, [lists[i] for i in p.requests], out.logits.argmax(-1), model.device,
                                         rank=rank)
            dout = draft(out.local_hidden, dinputs, meta, *draft_pools(pool, model))
        result.forward_seconds += time.perf_counter() - t0
        for j, (i, e) in enumerate(zip(p.requests, p.ends)):
            if e == len(lists[i]):
                result.logits[i] = out.logits[j].float()
                if draft is not None:
                    result.draft_logits[i] = dout.logits[j].float()
        for i, e, ch in chunks:
            first = int(out.logits[p.requests.index(i)].argmax()) if e == len(lists[i]) else None
            result.statuses[rooms[i]] = int(peer.end_chunk(ch, first_token=first, prompt_len=len(lists[i])))
        if on_pass is not None:
            on_pass(p)
    return result
