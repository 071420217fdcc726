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

from .batch import KVLayout
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
    from cpgraph.runtime.engine import run_prefill

    layout = make_layout(model, kv_format, page_size)

    def forward(ids, meta, mla, index, **kw):
        return model(ids, meta, mla, index, layout, **kw)

    res = run_prefill(forward, model, token_lists, prefix_lens=prefix_lens, kv_format=kv_format,
                      page_size=page_size, return_topk=return_topk, progress=progress)
    return PrefillResult(res.logits, res.kv_bytes, res.total_pages, res.topk, res.meta)


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
