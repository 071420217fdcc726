"""GraphRunner's padded index arrays read the same rows as the unpadded batch, at cp = 1, 2 and 4.

No model here: real plans with cached prefixes owned by several ranks, real
``build_batch`` metadata, and the runner's own load into a bucket's static
buffers.  The check is a brute force that does not use the layout formula:
it materialises, per rank, the gathered buffer of the unpadded batch
(``cat`` over ranks of ``[P prefix rows | M compute rows]``) and of the padded
one (``[P' rows | M' rows]``, the extra rows filled with a marker no real row
has), each row holding a value that names it, and asserts that every padded
index reads the row its unpadded index reads.  The same is done for the
indices into the gathered hidden states (``last_token_index``,
``rerange_index``: ``[M rows]`` per rank).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from cpgraph.models import build_batch
from cpgraph.plan import GatherLayout, plan_prefill
from cpgraph.runtime.graph_runner import Bucket, GraphRunner, _Static

PAGE = 16
PAD = -7  # the value of every padding row of a brute-force buffer (real rows are > 0)
# Cached prefixes of several pages (their owners spread over the ranks, unevenly), extends of every size.
PREFIX = [64, 32, 0, 48]
EXTEND = [20, 5, 33, 1]


def _owners(cp: int) -> list[list[int]]:
    """Owner rank of each cached prefix page: round-robin from a per-request start (uneven per-rank counts)."""
    return [[(i + k) % cp for k in range(p // PAGE)] for i, p in enumerate(PREFIX)]


def _rank_batches(cp: int, row_align: int = 1):
    """``(plan, [(ids, meta) per rank])`` for the test batch under ``cp`` ranks."""
    plan = plan_prefill(PREFIX, EXTEND, cp_size=cp, page_size=PAGE, row_align=row_align)
    owners = _owners(cp)
    tokens = [list(range(1, n + 1)) for n in EXTEND]
    out = []
    for rank in range(cp):
        pages = itertools.count()
        tables = [[next(pages) if o == rank else -1 for o in owners[i] + plan.page_owners(i)]
                  for i in range(len(EXTEND))]  # fmt: skip
        out.append(build_batch(plan, tokens, tables, rank=rank, prefix_page_owners=owners))
    return plan, out


def _gathered(blocks: list[tuple[int, int]], pad_to: tuple[int, int] | None) -> torch.Tensor:
    """Brute force: the rank-major buffer, ``[prefix | compute]`` per rank, each real row named by its value.

    ``blocks[r] = (P, M)``; a real row's value is ``1 + (rank, part, row)`` packed into an int,
    and ``pad_to = (P', M')`` appends ``PAD`` rows after each part.
    """
    parts = []
    for r, (p, m) in enumerate(blocks):
        for part, (n, n_pad) in enumerate(((p, pad_to[0] if pad_to else p), (m, pad_to[1] if pad_to else m))):
            parts.append(1 + r * 10**6 + part * 10**5 + torch.arange(n))
            parts.append(torch.full((n_pad - n,), PAD))
    return torch.cat(parts)


def _reads(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``buffer[index]`` with ``-1`` reading nothing (as ``take_rows``): -1 stays -1."""
    return torch.where(index >= 0, buffer[index.clamp(min=0)], torch.full_like(index, -1))


def _check_loaded(cp: int, ids, meta, static: _Static) -> None:
    p, m = meta.prefix_slots.shape[0], ids.shape[0]
    p2, m2 = static.meta.prefix_slots.shape[0], static.ids.shape[0]
    n, n2 = meta.kv_source.shape[0], static.meta.kv_source.shape[0]
    # KV view: every padded source reads the row the unpadded one reads; the padded tail reads nothing.
    want = _reads(_gathered([(p, m)] * cp, None), meta.kv_source)
    got = _reads(_gathered([(p, m)] * cp, (p2, m2)), static.meta.kv_source)
    assert torch.equal(got[:n], want), f"cp={cp}: {(got[:n] != want).sum().item()} of {n} KV-view rows read another row"
    assert (static.meta.kv_source[n:] == -1).all() and n2 >= n
    assert not (got == PAD).any()  # no view row reads a padding row
    # Prefix slots: the rank's own rows, then -1 (zero records).
    assert torch.equal(static.meta.prefix_slots[:p], meta.prefix_slots) and (static.meta.prefix_slots[p:] == -1).all()
    # Hidden-state indices: rank-major [M rows] per rank.
    hidden, hidden2 = _gathered([(0, m)] * cp, None), _gathered([(0, m)] * cp, (0, m2))
    for name in ("last_token_index", "rerange_index"):
        a, b = getattr(meta, name), getattr(static.meta, name)
        assert torch.equal(_reads(hidden2, b[: a.shape[0]]), _reads(hidden, a)), name
    # Compute rows: the batch's rows, then dummies (token 0, position 0, empty window, slot -1).
    assert torch.equal(static.ids[:m], ids) and (static.ids[m:] == 0).all()
    for name, fill in (("positions", 0), ("ks", 0), ("ke", 0), ("row_slots", -1)):
        a, b = getattr(meta, name), getattr(static.meta, name)
        assert torch.equal(b[:m], a) and (b[m:] == fill).all(), name


def _bucket(cp, ids, meta, extra_rows=0):
    p = meta.prefix_slots.shape[0]
    b = meta.last_token_index.shape[0]
    return Bucket(ids.shape[0] + extra_rows, meta.kv_source.shape[0] + 40, p + 48, b + 3, cp)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_padded_indices_read_the_same_rows(cp):
    plan, batches = _rank_batches(cp)
    assert len({meta.prefix_slots.shape[0] for _, meta in batches}) == 1  # P is the same on every rank
    assert batches[0][1].prefix_slots.shape[0] > 0 and (batches[-1][1].kv_source >= 0).any()
    for ids, meta in batches:
        # Under CP the runner never pads M (the planner does); at cp = 1 it does, and both move blocks.
        static = _Static(_bucket(cp, ids, meta, extra_rows=8 if cp == 1 else 0), meta, "cpu")
        static.load(ids, meta)
        _check_loaded(cp, ids, meta, static)


@pytest.mark.parametrize("cp", [2, 4])
def test_the_brute_force_catches_a_rank_zero_shift(cp):
    """Shifting every entry >= P by P' - P (right for rank 0 only) reads wrong rows for the other ranks."""
    _, batches = _rank_batches(cp)
    ids, meta = batches[-1]
    static = _Static(_bucket(cp, ids, meta), meta, "cpu")
    static.load(ids, meta)
    p, shift = meta.prefix_slots.shape[0], static.meta.prefix_slots.shape[0] - meta.prefix_slots.shape[0]
    static.meta.kv_source[: meta.kv_source.shape[0]] = torch.where(meta.kv_source >= p, meta.kv_source + shift,
                                                                   meta.kv_source)  # fmt: skip
    with pytest.raises(AssertionError, match="KV-view rows read another row"):
        _check_loaded(cp, ids, meta, static)


def test_repad_against_the_layout_definition_entry_by_entry():
    """``GatherLayout.repad`` against a layout rebuilt from its definition, entry by entry (plain Python)."""
    lay, padded = GatherLayout(3, 32, 24), GatherLayout(3, 64, 40)
    src = torch.tensor([-1] + list(range(lay.total_rows)))
    expect = [-1]
    for g in range(lay.total_rows):
        r, off = divmod(g, lay.block_rows)
        expect.append(r * padded.block_rows + (off if off < 32 else 64 + off - 32))
    assert lay.repad(src, padded).tolist() == expect
    assert GatherLayout(2, 0, 0).repad(torch.tensor([-1, -1]), GatherLayout(2, 16, 0)).tolist() == [-1, -1]
    with pytest.raises(ValueError, match="cannot pad"):
        lay.repad(src, GatherLayout(3, 16, 40))


def test_runner_under_cp_loads_the_remapped_view():
    """Through ``GraphRunner.__call__`` (capture off): the forward sees the re-mapped ``kv_source`` on every rank."""
    for cp in (2, 4):
        plan, batches = _rank_batches(cp, row_align=32)
        seen = []
        runner = GraphRunner(lambda i, m: seen.append((i.clone(), m.kv_source.clone())) or torch.zeros(8, 1),
                             max_requests=4, row_buckets=(plan.num_rows,), kv_buckets=(64, 96, 320),
                             cp_size=cp, capture=False)  # fmt: skip
        for ids, meta in batches:
            bucket = runner.bucket_for(ids, meta)
            assert bucket.prefix_rows > meta.prefix_slots.shape[0] and bucket.kv_rows > meta.kv_source.shape[0]
            runner(ids, meta)
            static = runner._static[bucket]
            assert torch.equal(seen[-1][1], static.meta.kv_source)
            _check_loaded(cp, ids, meta, static)
