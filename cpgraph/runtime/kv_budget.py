"""How many KV pages a serving rank can hold: what its memory leaves after the weights and one step's activations.

Why: a prefill node's pool is its cache (the radix hits, the prompts in
flight), so it should take what the device has left, and no more -- a pool
sized by hand either wastes the memory a cache hit would have used, or
leaves a step's activations without room and fails under load.  The rule,
applied once, after the weights are loaded and before the pool exists:

    usable      = free - (1 - fraction) * total          (CUDA: torch.cuda.mem_get_info)
                = fraction * MemAvailable                 (CPU: the host's available memory)
    activations = the memory plan's peak of one step      (cpgraph.plan.memory: rows = the token
                  (x2 with CUDA graphs: the captured        budget, keys = the longest context)
                  buckets keep a pool of their own)
    pages       = (usable - activations) // bytes per page (every layer's MLA records and index-K,
                                                           the MTP draft's layer included)

``fraction`` is the share of the device this rank may fill (the rest is
headroom: the allocator's fragmentation, NCCL's buffers, other processes).
The activation booking is the plan's for a step of ``token_budget`` rows per
rank whose KV view holds one context of ``max_context`` tokens (docs/launch.md
describes the plan and how it compares with measured peaks); a step that
batches several long contexts needs more, which the headroom covers.  Under
CP every rank computes its own figure and the group takes the smallest (the
lane ledger needs one capacity on every rank): :func:`agree_pages`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 2**30


@dataclass(frozen=True)
class PoolBudget:
    """One rank's KV-pool sizing (bytes per rank; ``pages`` before the CP group agrees on its minimum)."""

    pages: int
    bytes_per_page: int
    usable_bytes: int  # what the fraction of this device leaves after what is already allocated (the weights)
    activation_bytes: int  # booked for one step's activations (twice with CUDA graphs)

    def line(self) -> str:
        return (f"{self.pages} pages per rank ({self.pages * self.bytes_per_page / GIB:.2f} GiB, "
                f"{self.bytes_per_page} B a page): {self.usable_bytes / GIB:.2f} GiB usable after the weights, "
                f"{self.activation_bytes / GIB:.2f} GiB booked for a step's activations")


def _plan_dtype(model, weights: str | None) -> str:
    if weights == "fp8":
        return "fp8"
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(model.dtype, "bf16")


def usable_bytes(device, fraction: float) -> int:
    """Bytes this rank may still fill: ``fraction`` of the device (CUDA) or of the host's available memory."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"the KV memory fraction must be in (0, 1], got {fraction}")
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free - (1.0 - fraction) * total)
    from cpgraph.models.memory_check import _host_available

    avail = _host_available()
    if avail is None:
        raise ValueError("cannot size the KV pool automatically: this platform does not report its available "
                         "memory; give --num-pages")
    return int(fraction * avail)


def pool_budget(model, *, page_size: int, kv_format: str, token_budget: int, max_context: int, cp: int = 1,
                ep: int = 1, fraction: float = 0.9, cuda_graphs: bool = False, draft: bool = False,
                deterministic: bool = False, weights: str | None = None, usable: int | None = None) -> PoolBudget:
    """This rank's :class:`PoolBudget` (module docstring).  ``usable``: the bytes to share out (default: read
    from the model's device with ``fraction``).  Raises ``ValueError`` (one line) when not even one page fits."""
    from cpgraph.plan.memory import plan_memory

    from .engine import pool_config

    pc = pool_config(model, kv_format, page_size, 1, 0, draft=draft)
    per_page = pc.num_layers * pc.mla_bytes_per_page() + len(pc.active_index_layers) * pc.index_bytes_per_page()
    plan = plan_memory(model.config, tokens=max(int(max_context), 1), cp=cp, ep=ep,
                       row_bucket=max(int(token_budget), 1), dtype=_plan_dtype(model, weights),
                       kv_format="fp8" if kv_format == "fp8" else "bf16", page_size=page_size,
                       deterministic=deterministic)
    act = plan.activation_peak * (2 if cuda_graphs else 1)
    if usable is None:
        usable = usable_bytes(model.device, fraction)
    pages = (int(usable) - act) // per_page
    if pages < 1:
        raise ValueError(f"no room for a KV pool: {usable / GIB:.2f} GiB usable after the weights, "
                         f"{act / GIB:.2f} GiB booked for a step's activations (token budget {token_budget}, "
                         f"context {max_context}); lower --token-budget or give --num-pages")
    return PoolBudget(int(pages), per_page, int(usable), int(act))


def agree_pages(pages: int, group=None) -> int:
    """The smallest ``pages`` over the CP group (every rank must hold the same L1 capacity); one collective."""
    import torch.distributed as dist

    t = torch.tensor([int(pages)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())
