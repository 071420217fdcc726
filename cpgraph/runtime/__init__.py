"""Runtime state around the forward: the per-rank KV pool and its page allocator."""

from .kv_pool import KVPool, KVPoolConfig, KVPoolExhausted, OwnerLaneAllocator, slots_for_positions

__all__ = ["KVPool", "KVPoolConfig", "KVPoolExhausted", "OwnerLaneAllocator", "slots_for_positions"]
