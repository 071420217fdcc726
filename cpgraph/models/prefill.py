"""``prefill_logits``: the single-device convenience path (used by the CLI and external checks).

For each request, ``prefix_lens[i]`` tokens are first prefilled into the
paged cache (one batch of all requests that have a prefix), then the rest of
every prompt runs as an extend batch over the cache; the result is the fp32
logits of each prompt's last token.  Both passes use the planner with
``cp_size=1``, so the metadata is exactly what a CP rank would get.

``kv_format``: ``"bf16"`` (alias ``"dense"``) stores dense
``[latent | k_pe]`` records *in the model dtype* (fp32 for an fp32 model,
bf16 for a bf16 model) and dense index keys; ``"fp8"`` stores 656-byte MLA
records and FP8 index-K pages (needs ``kv_lora_rank == 512`` and
``qk_rope_head_dim == 64``).  Pages are ``page_size`` tokens (default 16);
prefix lengths must be multiples of it (cached prefixes are page aligned).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from cpgraph.plan import plan_prefill

from .batch import KVLayout, build_batch
from .model import DSAForCausalLM

DEFAULT_PAGE_SIZE = 16
_FORMATS = {"bf16": "dense", "dense": "dense", "fp8": "fp8"}


@dataclass
class PrefillResult:
    logits: Tensor  # fp32 [B, vocab] last-token logits
    kv_bytes: int  # bytes of KV cache pages used by the batch (MLA + index-K, all layers)
    num_pages: int
    topk: list[Tensor] | None = None  # extend pass, per layer int32 [M, topk] full-view ids
    meta: object | None = None  # extend pass BatchMeta (to interpret ``topk``)


def _check_inputs(model, token_lists, prefix_lens, page_size):
    vocab = model.config.vocab_size
    if not isinstance(token_lists, (list, tuple)) or not token_lists:
        raise ValueError("token_lists must be a non-empty list of token-id lists")
    lists = []
    for i, t in enumerate(token_lists):
        if isinstance(t, Tensor):
            t = t.tolist()  # sync-ok (host input)
        t = list(t)
        if not t:
            raise ValueError(f"prompt {i} is empty")
        for v in t:
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab:
                raise ValueError(f"prompt {i}: token {v!r} is not an int in [0, {vocab})")
        lists.append(t)
    if prefix_lens is None:
        prefix_lens = [0] * len(lists)
    prefix_lens = list(prefix_lens)
    if len(prefix_lens) != len(lists):
        raise ValueError(f"prefix_lens has {len(prefix_lens)} entries for {len(lists)} prompts")
    for i, (p, t) in enumerate(zip(prefix_lens, lists)):
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ValueError(f"prefix_lens[{i}] must be an int >= 0, got {p!r}")
        if p % page_size:
            raise ValueError(f"prefix_lens[{i}]={p} is not a multiple of the page size {page_size}")
        if p >= len(t):
            raise ValueError(f"prefix_lens[{i}]={p} leaves no tokens to extend (prompt has {len(t)})")
    return lists, prefix_lens


def make_layout(model: DSAForCausalLM, kv_format: str, page_size: int) -> KVLayout:
    if kv_format not in _FORMATS:
        raise ValueError(f"kv_format must be 'bf16' or 'fp8', got {kv_format!r}")
    fmt = _FORMATS[kv_format]
    cfg = model.config
    if fmt == "fp8":
        if (cfg.kv_lora_rank, cfg.qk_rope_head_dim) != (512, 64):
            raise ValueError(
                "kv_format='fp8' needs kv_lora_rank=512 and qk_rope_head_dim=64 (the 656-byte record), "
                f"this model has {cfg.kv_lora_rank} and {cfg.qk_rope_head_dim}"
            )
        D = cfg.index_head_dim
        if D > 128 or D & (D - 1):
            raise ValueError(f"kv_format='fp8' needs a power-of-two index_head_dim <= 128, got {D}")
    return KVLayout(kv_format=fmt, page_size=page_size)


def _make_pool(model: DSAForCausalLM, layout: KVLayout, num_pages: int):
    from cpgraph.runtime.kv_pool import KVPool, KVPoolConfig

    cfg = model.config
    return KVPool(
        KVPoolConfig(
            num_layers=cfg.num_hidden_layers,
            page_size=layout.page_size,
            num_pages=num_pages,
            kv_format=layout.kv_format,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_rope_dim=cfg.qk_rope_head_dim,
            index_head_dim=cfg.index_head_dim,
            index_layers=list(cfg.indexer_layers),
            dtype=model.dtype,
            device=model.device,
        )
    )


def _pool_tensors(pool, cfg) -> tuple[list[Tensor], list[Tensor]]:
    mla = [pool.mla_pool(i) for i in range(cfg.num_hidden_layers)]
    index = [pool.index_pool(i) for i in cfg.indexer_layers]
    return mla, index


@torch.no_grad()
def prefill(
    model: DSAForCausalLM,
    token_lists: Sequence[Sequence[int]],
    *,
    prefix_lens: Sequence[int] | None = None,
    kv_format: str = "bf16",
    page_size: int = DEFAULT_PAGE_SIZE,
    return_topk: bool = False,
    progress: Callable[[str], None] | None = None,
) -> PrefillResult:
    """Like :func:`prefill_logits` but also reports KV bytes (and optionally per-layer top-k)."""
    layout = make_layout(model, kv_format, page_size)
    lists, prefix = _check_inputs(model, token_lists, prefix_lens, page_size)
    ps = layout.page_size
    pages_per_req = [-(-len(t) // ps) for t in lists]
    total_pages = sum(pages_per_req)
    pool = _make_pool(model, layout, total_pages)
    page_tables = [pool.alloc_pages_with_owners([0] * n) for n in pages_per_req]
    mla, index = _pool_tensors(pool, model.config)
    device = model.device

    with_prefix = [i for i, p in enumerate(prefix) if p > 0]
    if with_prefix:
        if progress:
            progress(f"prefix pass: {len(with_prefix)} requests, {sum(prefix)} tokens")
        plan = plan_prefill([0] * len(with_prefix), [prefix[i] for i in with_prefix], cp_size=1, page_size=ps)
        ids, meta = build_batch(
            plan, [lists[i][: prefix[i]] for i in with_prefix], [page_tables[i] for i in with_prefix], device
        )
        model(ids, meta, mla, index, layout)

    extend = [len(t) - p for t, p in zip(lists, prefix)]
    if progress:
        progress(f"extend pass: {len(lists)} requests, {sum(extend)} tokens")
    plan = plan_prefill(prefix, extend, cp_size=1, page_size=ps)
    ids, meta = build_batch(plan, [t[p:] for t, p in zip(lists, prefix)], page_tables, device)
    out = model(ids, meta, mla, index, layout, return_topk=return_topk)
    kv_bytes = pool.bytes_per_page() * sum(pages_per_req)
    return PrefillResult(out.logits, kv_bytes, total_pages, out.topk, meta if return_topk else None)


def prefill_logits(
    model: DSAForCausalLM,
    token_lists: Sequence[Sequence[int]],
    *,
    prefix_lens: Sequence[int] | None = None,
    kv_format: str = "bf16",
) -> Tensor:
    """fp32 last-token logits ``[B, vocab]`` of each prompt (single device, paged cache).

    ``prefix_lens[i]`` tokens of prompt i are prefilled and cached first (must
    be a multiple of the page size, 16), then the rest runs as an extend over
    the cache.  ``kv_format``: ``"bf16"`` = dense records in the model dtype,
    ``"fp8"`` = 656-byte MLA records + FP8 index-K pages.
    """
    return prefill(model, token_lists, prefix_lens=prefix_lens, kv_format=kv_format).logits
