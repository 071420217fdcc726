"""Shared pieces of the L3 tests: the tiny model's eager forward, prompts, engines, and page-byte snapshots."""

from __future__ import annotations

import torch

from cpgraph.runtime.cache_engine import CacheEngine
from cpgraph.runtime.hicache import payloads_of
from cpgraph.runtime.radix import TokenKey
from cpgraph.runtime.storage import PageStore

PS = 16
# Warm (cached prefix) vs cold logits: other GEMM shapes, so a tolerance (the same-shape rule, docs/cache.md).
ATOL = 1e-5


def build_tiny():
    """``(model, forward, prompts)``: tiny-glm5 eager with :func:`prompts`."""
    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import make_layout

    model = from_pretrained("tiny-glm5").eval()
    layout = make_layout(model, "bf16", PS)

    def forward(ids, meta, mla, index, **kw):
        return model(ids, meta, mla, index, layout, **kw)

    return model, forward, prompts()


def prompts() -> list[list[int]]:
    """Three prompts sharing 40 tokens (two whole pages), then 30, 9 and 56 of their own."""
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 512, (40,), generator=g).tolist()
    return [shared + torch.randint(0, 512, (n,), generator=g).tolist() for n in (30, 9, 56)]


def engine(tiny, l3, **kw) -> CacheEngine:
    model, forward, _ = tiny
    kw.setdefault("host_pages", 48)
    return CacheEngine(forward, model, num_pages=48, page_size=PS, l3=l3, **kw)


def prefix_bytes(eng, tokens, pages):
    """Per logical page of ``tokens``' cached prefix: every payload's bytes of this engine's L1 page."""
    m = eng.tree.match_prefix(TokenKey(tokens), max_pages=pages)
    assert m.device_len == pages * PS
    views = [v for _, v in payloads_of(eng.pool)]
    return [[v[int(p)].clone() for v in views] for p in m.device_pages]


def same_bytes(got, want) -> bool:
    return len(got) == len(want) and all(torch.equal(a, b) for ga, wa in zip(got, want) for a, b in zip(ga, wa))


class FailingGets(PageStore):
    """A store whose ``get`` fails chosen positions of chosen batch calls (a backend that fails partway).

    ``fail[k]``: positions of the k-th ``get`` call (0-based) that return
    ``False`` although the inner store read them.  Everything else is the
    inner store's.
    """

    def __init__(self, inner: PageStore, fail: dict[int, set[int]]):
        super().__init__()
        self.inner, self.fail, self.calls = inner, fail, []
        self.name = f"failing({inner.name})"
        self.stats = inner.stats

    def register(self, buffer):
        self.inner.register(buffer)

    def exists(self, keys):
        return self.inner.exists(keys)

    def get(self, keys, parts):
        out = list(self.inner.get(keys, parts))
        bad = self.fail.get(len(self.calls), set())
        self.calls.append(len(keys))
        return [ok and j not in bad for j, ok in enumerate(out)]

    def put(self, keys, parts):
        return self.inner.put(keys, parts)

    def close(self):
        self.inner.close()


def counting(forward, rows: list):
    """``forward`` that appends each call's token count to ``rows`` (what a pass computed)."""
    def fwd(ids, meta, mla, index, **kw):
        rows.append(int(ids.numel()))
        return forward(ids, meta, mla, index, **kw)
    return fwd
