"""Per-rank KV pool and its owner-lane page allocator.

Under owner-sharded ("shared") KV every logical page of a request has exactly
one owner rank (the rank that computes its tokens, from the plan), and only
the owner stores it.  So a rank's pool is sized for *its* pages, and its
allocator serves one lane: given the owner of each logical page of a request
it hands out physical pages for the entries it owns and ``-1`` for the rest.
No rank ever needs another rank's physical page ids (materialising the full
view exchanges page *contents*, addressed by logical position), so the
allocator needs no communication.

Storage per layer follows the shared storage contract (``docs/kv_pool.md``):

* MLA: ``[num_pages * page_size, width]`` slot-major; ``"dense"`` records are
  ``[latent | k_pe]`` in the model dtype, ``"fp8"`` records are the 656-byte
  uint8 layout of :mod:`cpgraph.ops.codecs`;
* index-K, only for layers that run their own indexer (IndexCache "shared"
  layers reuse the previous layer's top-k and store nothing): ``"dense"``
  ``[num_pages * page_size, index_head_dim]`` model dtype, ``"fp8"``
  ``uint8 [num_pages, page_size * (index_head_dim + 4 nb)]``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..ops.codecs import (
    MLA_FP8_LATENT,
    MLA_FP8_RECORD_BYTES,
    MLA_FP8_ROPE,
    index_k_page_bytes,
)
from ..plan.slots import is_pow2 as _is_pow2
from ..plan.slots import slots_for_positions  # noqa: F401  (the planner's slot rule, re-exported: docs/kv_pool.md)

FORMATS = ("dense", "fp8")


class KVPoolExhausted(RuntimeError):
    """Not enough free pages on this rank's lane; nothing was allocated.

    Callers (radix eviction, HiCache load-back) catch this, evict for the
    deficit and retry, or degrade to a cache miss.
    """

    def __init__(self, rank: int, requested: int, free: int):
        self.rank, self.requested, self.free = rank, requested, free
        super().__init__(
            f"KV pool of rank {rank} exhausted: {requested} page(s) requested, {free} free; nothing was allocated"
        )


def _positive_int(name: str, x, allow_zero: bool = False) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < (0 if allow_zero else 1):
        kind = "non-negative" if allow_zero else "positive"
        raise ValueError(f"KVPoolConfig: {name} must be a {kind} int, got {x!r}")
    return int(x)


@dataclass(frozen=True)
class KVPoolConfig:
    """Geometry of one rank's KV pool.

    ``num_pages`` is this rank's capacity (pages it can own), not the batch
    total.  ``index_layers`` are the logical layer ids that run an indexer;
    only they get index-K storage.  ``index_format`` defaults to
    ``kv_format`` (production pairs a bf16 MLA cache with fp8 index keys
    too, so it can be set separately).  ``rank`` names this rank in errors
    and selects its lane in ``alloc_pages_with_owners``.
    """

    num_layers: int
    page_size: int
    num_pages: int
    kv_format: str = "dense"
    kv_lora_rank: int = 512
    qk_rope_dim: int = 64
    index_head_dim: int = 128
    index_layers: Sequence[int] = ()
    dtype: torch.dtype = torch.bfloat16
    device: torch.device | str = "cpu"
    rank: int = 0
    index_format: str | None = None
    _index_layers: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        _positive_int("num_layers", self.num_layers)
        _positive_int("num_pages", self.num_pages, allow_zero=True)
        _positive_int("kv_lora_rank", self.kv_lora_rank)
        _positive_int("qk_rope_dim", self.qk_rope_dim, allow_zero=True)
        _positive_int("index_head_dim", self.index_head_dim)
        _positive_int("rank", self.rank, allow_zero=True)
        if not _is_pow2(self.page_size):
            raise ValueError(f"KVPoolConfig: page_size must be a positive power of two, got {self.page_size!r}")
        for name in ("kv_format", "index_format"):
            value = getattr(self, name)
            if value is not None and value not in FORMATS:
                raise ValueError(f"KVPoolConfig: {name} must be one of {FORMATS}, got {value!r}")
        if self.kv_format == "fp8" and (self.kv_lora_rank, self.qk_rope_dim) != (MLA_FP8_LATENT, MLA_FP8_ROPE):
            raise ValueError(
                "KVPoolConfig: kv_format 'fp8' is the 656-byte record and needs kv_lora_rank 512 and "
                f"qk_rope_dim 64, got {self.kv_lora_rank} and {self.qk_rope_dim}"
            )
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"KVPoolConfig: dtype must be float32, bfloat16 or float16, got {self.dtype}")
        layers = [int(i) for i in self.index_layers]
        if len(set(layers)) != len(layers) or any(not 0 <= i < self.num_layers for i in layers):
            raise ValueError(
                f"KVPoolConfig: index_layers must be distinct layer ids in [0, {self.num_layers}), got {layers}"
            )
        object.__setattr__(self, "_index_layers", tuple(sorted(layers)))

    @property
    def active_index_layers(self) -> tuple[int, ...]:
        return self._index_layers

    @property
    def index_kind(self) -> str:
        return self.index_format or self.kv_format

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def mla_record(self) -> tuple[torch.dtype, int]:
        """``(dtype, width)`` of one MLA record."""
        if self.kv_format == "fp8":
            return torch.uint8, MLA_FP8_RECORD_BYTES
        return self.dtype, self.kv_lora_rank + self.qk_rope_dim

    def mla_bytes_per_page(self) -> int:
        dtype, width = self.mla_record
        return self.page_size * width * dtype.itemsize

    def index_bytes_per_page(self) -> int:
        if self.index_kind == "fp8":
            return index_k_page_bytes(self.page_size, self.index_head_dim)
        return self.page_size * self.index_head_dim * self.dtype.itemsize


class OwnerLaneAllocator:
    """Physical pages of one rank's lane; lowest free id first (deterministic).

    ``alloc_pages_with_owners`` is all-or-nothing, so a failed request leaves
    the free list exactly as it was.  ``free`` validates the whole list before
    returning anything, so a double free or a foreign id changes nothing.
    """

    def __init__(self, num_pages: int, rank: int):
        self.num_pages, self.rank = int(num_pages), int(rank)
        self._free = list(range(self.num_pages))  # a sorted list is a valid heap
        self._in_use = np.zeros(self.num_pages, dtype=bool)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc_pages_with_owners(self, owners: Sequence[int]) -> list[int]:
        """Physical page per logical page: a page id where ``owners[j] == rank``, else ``-1``.

        ``owners`` (ints, a numpy array or a CPU tensor) is the owner rank of
        each logical page, identical on all ranks (from the plan or a radix
        node's ``page_owners``).  Raises :class:`KVPoolExhausted` without
        allocating when the lane has too few free pages.
        """
        own = np.asarray(owners)
        if own.ndim != 1 or (own.size and not np.issubdtype(own.dtype, np.integer)):
            raise ValueError(f"alloc_pages_with_owners: owners must be a 1-D sequence of ints, got {owners!r}")
        own = own.astype(np.int64)
        if own.size and own.min() < 0:
            raise ValueError(f"alloc_pages_with_owners: owner ranks must be >= 0, got {own.min()}")
        return self.alloc_array(own).tolist()

    def alloc_array(self, own: np.ndarray) -> np.ndarray:
        """:meth:`alloc_pages_with_owners` for owners the caller has checked (a 1-D int64 array of ranks >= 0),
        as an int64 array: the ledgers' allocation path checks the owners once and keeps arrays (no list)."""
        mine = own == self.rank
        need = int(mine.sum())
        if need > len(self._free):
            raise KVPoolExhausted(self.rank, need, len(self._free))
        pages = np.array([heapq.heappop(self._free) for _ in range(need)], dtype=np.int64)
        self._in_use[pages] = True
        if need == own.shape[0]:  # every page is this rank's (always with one rank): no -1 entries to fill in
            return pages
        out = np.full(own.shape[0], -1, dtype=np.int64)
        out[mine] = pages
        return out

    def free(self, pages: Sequence[int]) -> None:
        """Return pages to the lane; ``-1`` entries (other owners' pages) are ignored."""
        arr = np.asarray(pages).reshape(-1)
        if arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
            # A float id would be truncated to some other page: refuse, never round.
            raise ValueError(f"free: page ids of rank {self.rank} must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
        arr = arr[arr != -1]
        bad = arr[(arr < 0) | (arr >= self.num_pages)]
        if bad.size:
            raise ValueError(f"free: rank {self.rank} has pages [0, {self.num_pages}), got unknown page {bad[0]}")
        uniq, counts = np.unique(arr, return_counts=True)
        twice = uniq[(counts > 1) | ~self._in_use[uniq]]
        if twice.size:
            raise ValueError(f"free: page {twice[0]} of rank {self.rank} is not allocated (double free)")
        self._in_use[arr] = False
        for p in arr.tolist():
            heapq.heappush(self._free, p)


class KVPool:
    """This rank's KV storage: per-layer MLA pools, index-K pools, and the page allocator."""

    def __init__(self, config: KVPoolConfig):
        self.config = c = config
        dtype, width = c.mla_record
        self.mla = [torch.zeros(c.num_slots, width, dtype=dtype, device=c.device) for _ in range(c.num_layers)]
        self.index_k: dict[int, torch.Tensor] = {}
        for layer in c.active_index_layers:
            if c.index_kind == "fp8":
                shape, idt = (c.num_pages, index_k_page_bytes(c.page_size, c.index_head_dim)), torch.uint8
            else:
                shape, idt = (c.num_slots, c.index_head_dim), c.dtype
            self.index_k[layer] = torch.zeros(shape, dtype=idt, device=c.device)
        self.allocator = OwnerLaneAllocator(c.num_pages, c.rank)

    # storage ---------------------------------------------------------------
    def mla_pool(self, layer: int) -> torch.Tensor:
        if not 0 <= layer < self.config.num_layers:
            raise ValueError(f"KVPool: layer {layer} outside [0, {self.config.num_layers})")
        return self.mla[layer]

    def index_pool(self, layer: int) -> torch.Tensor:
        if layer not in self.index_k:
            raise ValueError(
                f"KVPool: layer {layer} has no indexer (index layers: {list(self.config.active_index_layers)})"
            )
        return self.index_k[layer]

    def bytes_per_page(self) -> int:
        """Bytes one physical page costs across all layers (MLA everywhere, index-K on index layers)."""
        c = self.config
        return c.num_layers * c.mla_bytes_per_page() + len(c.active_index_layers) * c.index_bytes_per_page()

    def total_bytes(self) -> int:
        """Bytes actually held by the pool tensors (``num_pages * bytes_per_page()``)."""
        return sum(t.nbytes for t in self.mla) + sum(t.nbytes for t in self.index_k.values())

    # allocation ------------------------------------------------------------
    def alloc_pages_with_owners(self, owners: Sequence[int]) -> list[int]:
        return self.allocator.alloc_pages_with_owners(owners)

    def alloc_array(self, owners: np.ndarray) -> np.ndarray:
        return self.allocator.alloc_array(owners)

    def free(self, pages: Sequence[int]) -> None:
        self.allocator.free(pages)

    @property
    def num_free(self) -> int:
        return self.allocator.num_free
