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

from cpgraph.plan import CPPlan, GatherLayout, materialize_descriptors
from cpgraph.plan.memory import DEFAULT_MAX_LOGITS_BYTES
from cpgraph.plan.slots import slots_for_positions

KV_FORMATS = ("dense", "fp8")

# Every BatchMeta holds at least this many cached-prefix rows per rank (``prefix_slots``), the missing
# ones ``-1``.  Why: Dynamo specialises a dim of size 0 or 1 even under ``dynamic=True`` (0/1
# specialisation), so a pass without a cached prefix (``P == 0``: a cold prefill, the prefix pass
# of a run with cached prefixes, a server's first request) compiled a graph of its own and the next
# pass that reads cached pages compiled the forward again.  With ``P >= 2`` on every pass one
# symbolic graph serves both.  The pad rows change no value by construction: a ``-1`` slot gathers
# a zero row (never reading the pool) and ``kv_source`` never names a pad row, so no full-view row
# comes from one.  Cost: two zero rows per gather (and per rank in the CP all-gather) of a pass
# that has no prefix; no host sync (the pad is built on the host with the rest of the batch).
MIN_PREFIX_ROWS = 2


@dataclass(frozen=True)
class KVLayout:
    """Static cache layout: ``kv_format`` "dense" (records in the model dtype) or "fp8" (656-B records)."""

    kv_format: str = "dense"
    page_size: int = 16
    max_logits_bytes: int = DEFAULT_MAX_LOGITS_BYTES  # one definition: the planner models the same chunks

    def __post_init__(self):
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {self.kv_format!r}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")


@dataclass
class BatchMeta:
    """Device metadata of one flat batch of ``M`` compute rows (one rank's view).

    * ``positions [M]``: absolute position of each row (0 for dummy rows);
    * ``ks``/``ke [M]``: the row's causal key window in full-view coordinates
      (``ks == ke == 0`` for dummy rows);
    * ``row_slots [M]``: physical KV slot each row's record is written to,
      ``-1`` for dummy rows (they never write);
    * ``prefix_slots [P]``: physical slots of the cached-prefix rows this rank
      holds, in full-view order (``-1`` padding) -- read from the pool;
      ``P >= MIN_PREFIX_ROWS`` always: a batch without cached prefix rows
      (or fewer) gets ``-1`` pad rows, so ``P`` is never 0 or 1 and a
      ``dynamic=True`` compile serves cold and cached passes with one graph;
    * ``kv_source [N_kv]``: source row of every full-view row in
      ``[prefix rows ; current rows]`` (rank-major over the CP group), ``-1``
      for page-tail slack -- see ``cpgraph.ops.materialize``;
    * ``last_token_index [B]``: row of each request's last token (gathered
      coordinates: ``rank * M + row``);
    * ``rerange_index [T]``: row of every extend token in global order (same
      coordinates), used only for the all-hidden-states output.

    The same fields serve one device and a CP rank: only their values differ,
    which is what lets the compiler turn the single-device forward into the
    CP one without new graph inputs.
    """

    positions: Tensor
    ks: Tensor
    ke: Tensor
    row_slots: Tensor
    prefix_slots: Tensor
    kv_source: Tensor
    last_token_index: Tensor
    rerange_index: Tensor

    def to(self, device) -> "BatchMeta":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)})


pytree.register_dataclass(BatchMeta)


@dataclass
class DraftInputs:
    """What the MTP draft needs beyond :class:`BatchMeta`: each row's *next* token (one rank's view).

    * ``next_ids [M]``: the token at position + 1 of the row's request, from
      the prompt (host); 0 for dummy rows and for rows that are their
      request's last prompt token;
    * ``last_of [M]``: request index ``b`` for a row that is request ``b``'s
      last prompt token (its next token is the one the target samples), else -1;
    * ``sampled [B]``: the target's sampled token of each request (a device
      tensor produced after the target's forward; any value where unused).

    Built per rank from the plan by :func:`build_draft_inputs`; the row
    layout is exactly ``build_batch``'s, so the draft's rows are the rows
    the target computed on this rank (CP-local).
    """

    next_ids: Tensor
    last_of: Tensor
    sampled: Tensor

    def to(self, device) -> "DraftInputs":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)})


pytree.register_dataclass(DraftInputs)


def build_draft_inputs(plan: CPPlan, prompts: Sequence[Sequence[int]], sampled: Tensor | None = None,
                       device=None, *, rank: int = 0) -> DraftInputs:
    """Rank ``rank``'s :class:`DraftInputs` of a planned batch.

    ``prompts[i]``: request i's *whole* token list known so far (prefix and
    extend), so a row whose position + 1 lies inside it takes that token and
    a row at the prompt's end is marked for the sampled token.  A pass that
    ends before the prompt does (the cached-prefix pass) needs no sampled
    token.  ``sampled``: ``[B]`` ids (default zeros).
    """
    B = plan.num_requests
    if len(prompts) != B:
        raise ValueError(f"prompts ({len(prompts)}) and the plan ({B} requests) must describe the same requests")
    rp = plan.rank(rank, rerange=True)
    req = rp.req_index.numpy()
    pos = rp.positions.numpy()
    valid = rp.token_index.numpy() >= 0
    next_ids = np.zeros(req.shape[0], dtype=np.int64)
    last_of = np.full(req.shape[0], -1, dtype=np.int64)
    ends = (plan.prefix_lens + plan.extend_lens).tolist()  # sync-ok: host-side numpy, once per batch
    for i in range(B):
        full = np.asarray(prompts[i], dtype=np.int64)
        if full.shape[0] < ends[i]:
            raise ValueError(f"request {i}: prompt has {full.shape[0]} tokens, the plan computes up to {ends[i]}")
        rows = np.flatnonzero(valid & (req == i))
        nxt = pos[rows] + 1
        inside = nxt < full.shape[0]
        next_ids[rows[inside]] = full[nxt[inside]]
        last_of[rows[~inside]] = i
    if sampled is None:
        sampled = torch.zeros(B, dtype=torch.int64)
    elif sampled.shape != (B,):
        raise ValueError(f"sampled must hold one token per request, shape ({B},), got {tuple(sampled.shape)}")
    out = DraftInputs(torch.from_numpy(next_ids), torch.from_numpy(last_of), sampled.to(torch.int64))
    return out.to(device) if device is not None else out


def pad_prefix_rows(prefix_slots: Tensor, kv_source: Tensor, layout: GatherLayout,
                    min_rows: int = MIN_PREFIX_ROWS) -> tuple[Tensor, Tensor]:
    """``(prefix_slots, kv_source)`` with at least ``min_rows`` prefix rows per rank (see :data:`MIN_PREFIX_ROWS`).

    ``layout``: the gathered-buffer coordinates ``kv_source`` indexes (its
    ``prefix_rows`` is ``prefix_slots``' length).  The new rows are ``-1``
    slots appended to every rank's prefix block; ``kv_source`` is re-mapped
    into the padded layout with :meth:`GatherLayout.repad` (under CP every
    rank's block moves, at ``cp_size == 1`` the current rows shift by the
    pad) and never names a pad row.  Returned unchanged when ``P`` is
    already ``>= min_rows``.
    """
    P = prefix_slots.shape[0]
    if P != layout.prefix_rows:
        raise ValueError(f"pad_prefix_rows: prefix_slots has {P} rows, the layout {layout.prefix_rows}")
    if P >= min_rows:
        return prefix_slots, kv_source
    padded = replace(layout, prefix_rows=min_rows)
    pad = torch.full((min_rows - P,), -1, dtype=prefix_slots.dtype, device=prefix_slots.device)
    return torch.cat([prefix_slots, pad]), layout.repad(kv_source, padded)


def build_batch(
    plan: CPPlan,
    tokens: Sequence[Sequence[int]],
    page_tables: Sequence[Sequence[int]],
    device=None,
    *,
    rank: int = 0,
    prefix_page_owners: Sequence[Sequence[int]] | None = None,
) -> tuple[Tensor, BatchMeta]:
    """Forward inputs of rank ``rank`` for one planned batch: ``(input_ids [M], meta)``.

    ``tokens[i]`` are request i's *extend* tokens (its prefix is already in
    the cache).  ``page_tables[i]`` is this rank's physical page for every
    page of request i (cached prefix pages, then extend pages), ``-1`` where
    another rank owns the page.  ``prefix_page_owners[i]`` is the owner rank
    of each cached prefix page (default: all rank 0, the single-device case);
    extend pages are owned as the plan says.  Host-side numpy work, once per
    batch; raises ``ValueError`` when the page tables contradict the owners.
    """
    B = len(tokens)
    if len(page_tables) != B or plan.num_requests != B:
        raise ValueError(f"tokens ({B}), page_tables ({len(page_tables)}) and the plan must describe the same requests")
    ps, cp = plan.page_size, plan.cp_size
    prefix_pages = (plan.prefix_lens // ps).tolist()  # sync-ok: host-side numpy, once per batch
    if prefix_page_owners is None:
        if cp != 1 and any(prefix_pages):
            raise ValueError("prefix_page_owners is required for a CP plan with cached prefixes")
        prefix_page_owners = [[0] * n for n in prefix_pages]
    flat = np.concatenate([np.asarray(t, dtype=np.int64) for t in tokens])
    if flat.shape[0] != plan.num_tokens:
        raise ValueError("tokens do not match the plan's extend lengths")
    rp = plan.rank(rank, rerange=True)
    tok_idx = rp.token_index.numpy()
    req = rp.req_index.numpy()
    pos = rp.positions.numpy()
    valid = tok_idx >= 0
    input_ids = np.where(valid, flat[np.clip(tok_idx, 0, None)], 0)

    tables = []
    for i in range(B):
        need = prefix_pages[i] + int(plan.num_pages[i])
        table = np.asarray(page_tables[i], dtype=np.int64)
        if table.ndim != 1 or table.shape[0] < need:
            raise ValueError(f"request {i}: page table has {table.shape[0]} pages, needs {need}")
        tables.append(table[:need])
    # Rows: a rank computes only tokens of pages it owns, so every row's page is local.
    row_slots = np.full(tok_idx.shape[0], -1, dtype=np.int64)
    for i in range(B):
        rows = np.flatnonzero(req == i)
        if rows.size:
            row_slots[rows] = slots_for_positions(tables[i], pos[rows], ps)
            if (row_slots[rows] < 0).any():
                raise ValueError(f"request {i}: rank {rank} computes rows whose pages it does not own")
    local_prefix = [tables[i][: prefix_pages[i]] for i in range(B)]
    desc = materialize_descriptors(plan, prefix_page_owners, local_prefix, rank)
    prefix_slots, kv_source = pad_prefix_rows(desc.send_slots, desc.kv_source, desc.layout)
    meta = BatchMeta(
        positions=rp.positions,
        ks=rp.ks,
        ke=rp.ke,
        row_slots=torch.from_numpy(row_slots),
        prefix_slots=prefix_slots,
        kv_source=kv_source,
        last_token_index=rp.last_token_index,
        rerange_index=rp.rerange_index,
    )
    ids = torch.from_numpy(input_ids)
    if device is not None:
        ids, meta = ids.to(device), meta.to(device)
    return ids, meta
