"""KV-cache bytes: one token's records over all layers, and the pages a rank owns under the zigzag split.

Why apart from the activations: the cache lives across forwards and is sized
by the whole context and its owner sharding, not by one forward's rows;
``benchmarks/cp_scaling.py`` uses these two functions on their own.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ..split import chunk_owner, split_requests
from .formats import FP8_SCALE_BLOCK, KV_FORMATS, MLA_FP8_RECORD_BYTES, _act_bytes

if TYPE_CHECKING:  # pragma: no cover
    from cpgraph.models.config import DSAConfig


def kv_bytes_per_token(cfg: "DSAConfig", kv_format: str = "bf16", index_format: str | None = None,
                       dtype: str = "bf16") -> dict[str, int]:
    """Bytes one token occupies in the cache, all layers: ``{"mla": ..., "index": ...}``.

    ``kv_format`` "bf16"/"dense" = records in the model dtype, "fp8" = the
    656-byte record; ``index_format`` defaults to ``kv_format`` (as cpgraph's
    engine allocates); index-K exists only for layers with their own indexer.
    """
    for name, fmt in (("kv_format", kv_format), ("index_format", index_format)):
        if fmt is not None and fmt not in KV_FORMATS:
            raise ValueError(f"plan_memory: argument '{name}' must be one of {', '.join(KV_FORMATS)}, got {fmt!r}")
    index_format = index_format or kv_format
    a = _act_bytes(dtype)
    if kv_format == "fp8":
        if (cfg.kv_lora_rank, cfg.qk_rope_head_dim) != (512, 64):
            raise ValueError("plan_memory: kv_format 'fp8' is the 656-byte record of kv_lora_rank 512 and rope 64")
        mla = MLA_FP8_RECORD_BYTES
    else:
        mla = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * a
    d = cfg.index_head_dim
    index = d + 4 * math.ceil(d / FP8_SCALE_BLOCK) if index_format == "fp8" else d * a
    n_index = sum(1 for t in cfg.indexer_types if t == "full")
    return {"mla": cfg.num_hidden_layers * mla, "index": n_index * index}


def owned_pages(tokens: int, cp: int, page_size: int) -> tuple[int, int]:
    """``(largest pages any rank owns, total pages)`` of one request of ``tokens`` under the zigzag split."""
    split = split_requests(np.array([tokens]), cp_size=cp, page_size=page_size)
    sizes = (split.page_end - split.page_start)[0]
    per_rank = np.bincount(chunk_owner(2 * cp), weights=sizes, minlength=cp)
    return int(per_rank.max()), int(split.num_pages[0])
