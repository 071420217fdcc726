"""What decode tells prefill about its KV buffers, and the layout fingerprint.

Both sides build a :class:`PoolLayout` from their own :class:`KVPool`.  The
fingerprint hashes everything that decides the *meaning* of a page's bytes
(record format and dtype, latent/rope/index dims, which logical layers carry
index-K, page size, bytes per page).  Prefill refuses a registration whose
fingerprint differs: mismatched layouts would otherwise transfer without
error and decode garbage.  Pointers are not part of the fingerprint (they
differ per process by nature) but are checked for count and alignment.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from cpgraph.runtime.kv_pool import KVPool


def fingerprint(pool: KVPool) -> str:
    c = pool.config
    facts = {
        "kv_format": c.kv_format,
        "index_format": c.index_kind,
        "dtype": str(c.dtype),
        "kv_lora_rank": c.kv_lora_rank,
        "qk_rope_dim": c.qk_rope_dim,
        "index_head_dim": c.index_head_dim,
        "num_layers": c.num_layers,
        "index_layers": list(c.active_index_layers),
        "page_size": c.page_size,
        "mla_page_bytes": c.mla_bytes_per_page(),
        "index_page_bytes": c.index_bytes_per_page(),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class PoolLayout:
    """Base addresses and page strides of one process's KV pool (page ``p`` of a layer at ``base + p * bytes``)."""

    fingerprint: str
    page_size: int
    mla_ptrs: tuple[int, ...]
    mla_page_bytes: int
    index_layers: tuple[int, ...]
    index_ptrs: tuple[int, ...]
    index_page_bytes: int

    @classmethod
    def of(cls, pool: KVPool) -> "PoolLayout":
        c = pool.config
        layers = tuple(c.active_index_layers)
        return cls(
            fingerprint=fingerprint(pool),
            page_size=c.page_size,
            mla_ptrs=tuple(t.data_ptr() for t in pool.mla),
            mla_page_bytes=c.mla_bytes_per_page(),
            index_layers=layers,
            index_ptrs=tuple(pool.index_k[i].data_ptr() for i in layers),
            index_page_bytes=c.index_bytes_per_page(),
        )

    def mismatch(self, other: "PoolLayout") -> str | None:
        """Why ``other`` (a peer's layout) cannot pair with this one, or ``None``."""
        if other.fingerprint != self.fingerprint:
            return (f"KV layout fingerprint mismatch: peer {other.fingerprint} != local {self.fingerprint} "
                    "(record format, dtype, dims, index layers or page size differ)")
        if other.page_size != self.page_size or other.mla_page_bytes != self.mla_page_bytes \
                or other.index_page_bytes != self.index_page_bytes:
            return "page size or page bytes differ although fingerprints match"
        if len(other.mla_ptrs) != len(self.mla_ptrs):
            return f"peer registered {len(other.mla_ptrs)} MLA layers, local pool has {len(self.mla_ptrs)}"
        if other.index_layers != self.index_layers or len(other.index_ptrs) != len(self.index_layers):
            return f"peer index layers {list(other.index_layers)} != local {list(self.index_layers)}"
        if any(p == 0 for p in other.mla_ptrs + other.index_ptrs):
            return "peer registered a null base address"
        return None
