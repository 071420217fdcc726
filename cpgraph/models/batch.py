"""The per-batch device bundle the forward reads, and how it is built.

:class:`BatchMeta` is a dataclass of tensors registered as a pytree, so a
compiled forward takes it as an ordinary input (shapes may be marked
dynamic; values never cause recompiles).  It is built **once per batch** on
the host from the planner (``cp_size=1`` here; the CP pass later swaps in a
rank's bundle) plus the pool's page tables, then moved to the device in one
go.  Nothing in the forward derives metadata from data.

:class:`KVLayout` holds the static cache facts (record format, page size,
indexer logits budget); they are Python constants, part of the compiled
graph's identity, never tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Sequence

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch import Tensor

from cpgraph.plan import RankPlan
from cpgraph.runtime.kv_pool import slots_for_positions

KV_FORMATS = ("dense", "fp8")


@dataclass(frozen=True)
class KVLayout:
    """Static cache layout: ``kv_format`` "dense" (records in the model dtype) or "fp8" (656-B records)."""

    kv_format: str = "dense"
    page_size: int = 16
    max_logits_bytes: int = 64 << 20

    def __post_init__(self):
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {self.kv_format!r}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")


@dataclass
class BatchMeta:
    """Device metadata of one flat batch of ``M`` compute rows.

    * ``positions [M]``: absolute position of each row (0 for dummy rows);
    * ``ks``/``ke [M]``: the row's causal key window in full-view coordinates
      (``ks == ke == 0`` for dummy rows);
    * ``row_slots [M]``: physical KV slot each row's record is written to,
      ``-1`` for dummy rows (they never write);
    * ``kv_slots [N_kv]``: physical slot of every full-view row (page-tail
      slack rows point at allocated slots never inside any window);
    * ``valid_rows [V]``: real rows, compacted around the MoE router;
    * ``last_token_index [B]``: row of each request's last token.
    """

    positions: Tensor
    ks: Tensor
    ke: Tensor
    row_slots: Tensor
    kv_slots: Tensor
    valid_rows: Tensor
    last_token_index: Tensor

    def to(self, device) -> "BatchMeta":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)})


pytree.register_dataclass(BatchMeta)


def build_batch(
    plan: RankPlan,
    tokens: Sequence[Sequence[int]],
    page_tables: Sequence[Sequence[int]],
    device=None,
) -> tuple[Tensor, BatchMeta]:
    """Turn a ``cp_size=1`` rank plan, the extend tokens and page tables into forward inputs.

    ``tokens[i]`` are request i's *extend* tokens (the prefix is already in the
    cache); ``page_tables[i]`` its physical pages covering
    ``kv_lens[i]`` positions.  Returns ``(input_ids [M], meta)`` on ``device``.
    Host-side numpy work, once per batch.
    """
    if plan.cp_size != 1:
        raise ValueError(f"build_batch builds single-device batches; got a plan with cp_size={plan.cp_size}")
    B = len(tokens)
    if len(page_tables) != B or plan.prefix_lens.shape[0] != B:
        raise ValueError(f"tokens ({B}), page_tables ({len(page_tables)}) and the plan must describe the same requests")
    ps = plan.page_size
    flat = np.concatenate([np.asarray(t, dtype=np.int64) for t in tokens])
    tok_idx = plan.token_index.cpu().numpy()  # sync-ok (host-side batch building)
    req = plan.req_index.cpu().numpy()  # sync-ok
    pos = plan.positions.cpu().numpy()  # sync-ok
    kv_lens = plan.kv_lens.cpu().numpy()  # sync-ok
    valid = tok_idx >= 0
    if flat.shape[0] != int(plan.extend_lens.sum()):
        raise ValueError("tokens do not match the plan's extend lengths")
    input_ids = np.where(valid, flat[np.clip(tok_idx, 0, None)], 0)
    row_slots = np.full(tok_idx.shape[0], -1, dtype=np.int64)
    kv_slots = []
    for i in range(B):
        need = -(-int(kv_lens[i]) // ps)
        if len(page_tables[i]) < need:
            raise ValueError(f"request {i}: page table has {len(page_tables[i])} pages, needs {need}")
        rows = np.nonzero(req == i)[0]
        row_slots[rows] = slots_for_positions(page_tables[i], pos[rows], ps)
        kv_slots.append(slots_for_positions(page_tables[i], np.arange(int(kv_lens[i])), ps))
    meta = BatchMeta(
        positions=plan.positions.clone(),
        ks=plan.ks.clone(),
        ke=plan.ke.clone(),
        row_slots=torch.from_numpy(row_slots),
        kv_slots=torch.from_numpy(np.concatenate(kv_slots)),
        valid_rows=plan.valid_rows.clone(),
        last_token_index=plan.last_token_index.clone(),
    )
    ids = torch.from_numpy(input_ids)
    if device is not None:
        ids, meta = ids.to(device), meta.to(device)
    return ids, meta
