"""Radix prefix cache: page-multiple matches, metadata splits, locks, LRU eviction, rank-identical decisions."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpgraph.runtime.radix import CPNodeMeta, LaneLedger, RadixCache, TokenKey, check_consistent

PS = 4


def _brute_hit(query, inserted, ps, max_pages=None):
    """Longest page-aligned common prefix of ``query`` with any inserted key (plain Python)."""
    best = 0
    for key in inserted:
        n = 0
        while n < min(len(query), len(key)) and query[n] == key[n]:
            n += 1
        best = max(best, n // ps * ps)
    if max_pages is not None:
        best = min(best, max_pages * ps)
    return best


def _insert(tree, tokens, cp, rank, seed):
    """Insert the whole pages of ``tokens`` with seeded owners; returns (pages, owners) used."""
    n = len(tokens) // tree.page_size
    rng = np.random.default_rng(seed)
    owners = rng.integers(0, cp, size=n)
    pages = np.where(owners == rank, rng.integers(0, 1000, size=n), -1)
    m = tree.match_prefix(TokenKey(tokens)).device_len // tree.page_size
    res = tree.insert(TokenKey(tokens)[: n * tree.page_size], pages, owners, matched_pages=m)
    return pages, owners, res


seqs = st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=24), min_size=1, max_size=8)


@settings(max_examples=25, deadline=None)
@given(seqs, st.lists(st.integers(0, 2), max_size=24), st.one_of(st.none(), st.integers(0, 6)))
def test_match_is_page_multiple_and_longest(inserted, query, max_pages):
    tree = RadixCache(PS, rank=0, cp_size=2)
    for k, toks in enumerate(inserted):
        _insert(tree, toks, 2, 0, k)
    m = tree.match_prefix(TokenKey(query), max_pages=max_pages)
    assert m.device_len % PS == 0
    assert m.device_len == _brute_hit(query, [t[: len(t) // PS * PS] for t in inserted], PS, max_pages)
    got = b"".join(n.key for n in m.nodes)
    assert got == TokenKey(query).raw()[: len(got)]
    assert m.page_owners.shape == m.device_pages.shape == (m.device_len // PS,)


@settings(max_examples=25, deadline=None)
@given(seqs, st.integers(0, 2))
def test_splits_keep_metadata_consistent(inserted, rank):
    cp = 3
    tree = RadixCache(PS, rank=rank, cp_size=cp)
    first = {}
    for k, toks in enumerate(inserted):
        pages, owners, _ = _insert(tree, toks, cp, rank, k)
        for j in range(len(toks) // PS):  # the first insert of a page prefix wins
            first.setdefault(tuple(toks[: (j + 1) * PS]), (pages[j], owners[j]))
    for node in tree.nodes():
        meta = node.meta
        assert len(node.key) == meta.num_pages * PS * 4 and meta.page_size == PS
        assert meta.page_owners.dtype == np.int8
        assert np.array_equal(meta.owned_positions, np.flatnonzero(meta.page_owners == rank))
        assert np.array_equal(node.device_pages >= 0, meta.page_owners == rank)
    for toks in inserted:
        n = len(toks) // PS
        m = tree.match_prefix(TokenKey(toks))
        assert m.device_len == n * PS
        for j in range(n):
            page, owner = first[tuple(toks[: (j + 1) * PS])]
            assert m.device_pages[j] == page and m.page_owners[j] == owner


def test_meta_split_page_aligned():
    owners = np.array([0, 1, 1, 0, 2, 1], dtype=np.int8)
    meta = CPNodeMeta.build(owners, 8, rank=1)
    head, tail = meta.split(16)
    assert head.page_owners.tolist() == [0, 1] and tail.page_owners.tolist() == [1, 0, 2, 1]
    assert head.owned_positions.tolist() == [1] and tail.owned_positions.tolist() == [0, 3]
    with pytest.raises(ValueError, match="not a multiple"):
        meta.split(12)
    with pytest.raises(ValueError, match="outside"):
        meta.split(48)


def test_token_key_slices_are_views():
    key = TokenKey(list(range(100)))
    sub = key[10:50][5:20]
    assert sub._raw is key._raw and (sub.start, sub.end) == (15, 30)
    assert sub.tokens().tolist() == list(range(15, 30))
    with pytest.raises(ValueError):
        TokenKey([1.5, 2.0])
    with pytest.raises(ValueError):
        TokenKey([-1])


def _chain(tree, tokens, parts, rank=0):
    """Insert ``tokens`` in ``parts`` growing prefixes (a path of ``parts`` nodes)."""
    n = len(tokens) // PS
    for k in range(1, parts + 1):
        j = n * k // parts
        m = (n * (k - 1)) // parts
        tree.insert(TokenKey(tokens[: j * PS]), np.arange(j) + 100 * rank, np.zeros(j, dtype=np.int64), matched_pages=m)


def test_lock_and_eviction_accounting():
    tree = RadixCache(PS)
    a = list(range(16))  # 4 pages
    b = list(range(8)) + [99] * 8  # shares 2 pages with a
    _chain(tree, a, 1)
    tree.insert(TokenKey(b), np.array([0, 1, 7, 8]), np.zeros(4, dtype=np.int64), matched_pages=2)
    assert tree.device_pages_total == 6 and tree.locked_pages == 0 and tree.evictable_pages == 6
    m = tree.match_prefix(TokenKey(b))
    tree.inc_lock(m.nodes[-1])  # locks b's leaf and the shared head
    assert tree.locked_pages == 4 and tree.evictable_pages == 2
    freed = []
    assert tree.evict(100, lambda n: freed.append(n.device_pages.tolist()) or False) == 2
    assert freed == [[2, 3]] and tree.device_pages_total == 4
    assert tree.match_prefix(TokenKey(a)).device_len == 8  # a's tail is gone, shared head stays
    tree.dec_lock(m.nodes[-1])
    assert tree.locked_pages == 0
    with pytest.raises(RuntimeError, match="not locked"):
        tree.dec_lock(m.nodes[-1])
    assert tree.evict(100, lambda n: False) == 4 and tree.device_pages_total == 0 and not list(tree.nodes())


def test_lru_order_and_lane_eviction():
    tree = RadixCache(PS, cp_size=2)
    keys = [[k] * 8 for k in range(3)]  # three 2-page leaves under the root
    lanes = [[0, 0], [1, 1], [0, 1]]
    for k, lane in zip(keys, lanes):
        tree.insert(TokenKey(k), np.where(np.array(lane) == 0, np.arange(2), -1), np.array(lane))  # rank 0's ids
    tree.match_prefix(TokenKey(keys[0]))  # touch leaf 0: now leaf 1 is the oldest
    order = []
    tree.evict(2, lambda n: order.append(n.key[:4]) or False)
    assert order == [TokenKey(keys[1]).raw()[:4]]
    # Lane 0 deficit of 1 page: the oldest leaf holding lane-0 pages is leaf 2 (leaf 1 is gone).
    order.clear()
    assert tree.evict(1, lambda n: order.append(n.key[:4]) or False, lane=0) == 1
    assert order == [TokenKey(keys[2]).raw()[:4]]


def test_identical_decisions_across_ranks():
    """Same operations on rank 0 and rank 1 (different physical pages) give the same fingerprint."""
    rng = np.random.default_rng(3)
    trees = [RadixCache(PS, rank=r, cp_size=2) for r in range(2)]
    for step in range(30):
        toks = rng.integers(0, 3, size=int(rng.integers(4, 30))).tolist()
        owners = rng.integers(0, 2, size=len(toks) // PS)
        for r, tree in enumerate(trees):
            m = tree.match_prefix(TokenKey(toks)).device_len // PS
            pages = np.where(owners == r, np.arange(owners.size) + 1000 * r, -1)
            tree.insert(TokenKey(toks)[: owners.size * PS], pages, owners, matched_pages=m)
            if step % 7 == 6:
                tree.evict(5, lambda n: False, lane=int(step % 2))
    assert trees[0].fingerprint() == trees[1].fingerprint()
    trees[1].match_prefix(TokenKey([0, 0, 0, 0]))  # one extra access changes the LRU clock
    assert trees[0].fingerprint() != trees[1].fingerprint()
    check_consistent(trees[0])  # no process group / debug off: a no-op


def test_lane_ledger():
    led = LaneLedger([3, 2])
    assert led.deficit([0, 1, 1, 1]) == {1: 1}
    led.take([0, 1])
    assert led.free_pages().tolist() == [2, 1] and led.deficit([1, 1]) == {1: 1}
    with pytest.raises(RuntimeError):
        led.take([1, 1])
    led.give([0, 1])
    with pytest.raises(RuntimeError):
        led.give([0])
    with pytest.raises(ValueError, match="owner outside"):
        led.counts([2])


def test_owners_are_validated_against_the_cp_size():
    tree = RadixCache(PS, rank=0, cp_size=2)
    key = TokenKey(list(range(8)))
    for owners, where in (([0, 256], "page_owners[1] = 256"), ([2, 0], "page_owners[0] = 2"), ([-1, 0], "page_owners[0] = -1")):
        with pytest.raises(ValueError, match=rf"RadixCache.insert: {re.escape(where)}.*not a rank of the CP group \[0, 2\)"):
            tree.insert(key, [-1, 5], owners)
    with pytest.raises(ValueError, match="page_owners must hold integers, got dtype float64"):
        tree.insert(key, [5, -1], [0.0, 1.0])
    assert not list(tree.nodes()) and tree.device_pages_total == 0  # nothing was stored (256 used to wrap to 0)
    tree.insert(key, [5, -1], [0, 1])
    assert tree.match_prefix(key).page_owners.tolist() == [0, 1]
    for bad, message in ((129, "cp_size must be in \\[1, 128\\] \\(page owners are int8\\), got 129"),
                         (0, "cp_size must be in")):
        with pytest.raises(ValueError, match=message):
            RadixCache(PS, cp_size=bad)
    with pytest.raises(ValueError, match="rank must be in \\[0, 2\\), got 2"):
        RadixCache(PS, rank=2, cp_size=2)
    RadixCache(PS, rank=127, cp_size=128)


def test_page_ids_must_be_integers_and_match_the_owners():
    tree = RadixCache(PS, rank=1, cp_size=2)
    key = TokenKey(list(range(8)))
    with pytest.raises(ValueError, match="device_pages must hold integers, got dtype float64"):
        tree.insert(key, [-1, 3.7], [0, 1])  # used to be truncated to page 3
    with pytest.raises(ValueError, match="logical page 1 has owner 1 and page id -1 on rank 1"):
        tree.insert(key, [-1, -1], [0, 1])
    with pytest.raises(ValueError, match="logical page 0 has owner 0 and page id 4 on rank 1"):
        tree.insert(key, [4, 3], [0, 1])
    assert not list(tree.nodes())


@pytest.mark.parametrize("matched", [-1, 3, 1.0, True, None])
def test_matched_pages_out_of_range_is_refused(matched):
    tree = RadixCache(PS)
    key = TokenKey(list(range(8)))
    with pytest.raises(ValueError, match=r"matched_pages must be an int in \[0, 2\]"):
        tree.insert(key, [0, 1], [0, 0], matched_pages=matched)
    assert not list(tree.nodes()) and tree.device_pages_total == 0


def test_matched_pages_beyond_the_cached_prefix_is_refused():
    tree = RadixCache(PS)
    tree.insert(TokenKey(list(range(4))), [0], [0])
    with pytest.raises(ValueError, match="matched_pages=2 but only 1 leading page"):
        tree.insert(TokenKey(list(range(8))), [0, 1], [0, 0], matched_pages=2)
    assert tree.device_pages_total == 1
    res = tree.insert(TokenKey(list(range(8))), [0, 1], [0, 0], matched_pages=1)
    assert res.adopted.tolist() == [True, True] and tree.device_pages_total == 2


def test_matched_pages_minus_one_used_to_leak_a_page():
    """-1 used to mark every page but the last as adopted; the caller then freed nothing and leaked."""
    tree = RadixCache(PS)
    with pytest.raises(ValueError):
        tree.insert(TokenKey(list(range(12))), [0, 1, 2], [0, 0, 0], matched_pages=-1)


def test_failed_release_leaves_eviction_counts_unchanged():
    tree = RadixCache(PS)
    tree.insert(TokenKey(list(range(8))), [0, 1], [0, 0])
    (leaf,) = tree.nodes()

    def failing_release(node):
        raise RuntimeError("backup failed")

    with pytest.raises(RuntimeError, match="backup failed"):
        tree.evict(2, failing_release)
    assert tree.device_pages_total == 2 and tree.evictable_pages == 2
    assert leaf.device_pages.tolist() == [0, 1]
    assert tree.evict(2, lambda n: False) == 2 and tree.device_pages_total == 0


# ------------------------------------------------- draft continuation tokens
def _one_rank_insert(tree, tokens, next_token, matched=0):
    n = len(tokens) // tree.page_size
    return tree.insert(TokenKey(tokens)[: n * tree.page_size], np.arange(100, 100 + n), np.zeros(n, np.int64),
                       matched_pages=matched, next_token=next_token)


@pytest.mark.parametrize("draft", [False, True])
def test_match_backs_off_one_page_where_the_continuation_differs_only_with_draft_records(draft):
    tree = RadixCache(PS, draft_records=draft)
    a = list(range(1, 13))  # 3 pages
    _one_rank_insert(tree, a, next_token=50)
    # Continues like the cached key after every node end: full hit either way.
    assert tree.match_prefix(TokenKey(a + [50, 7])).device_len == 12
    # Diverges right after page 2 (inside a's node): the split head's continuation is a's token 9.
    b = a[:8] + [60, 61, 62]
    assert tree.match_prefix(TokenKey(b)).device_len == (4 if draft else 8)
    head = tree.root.children[TokenKey(a[:4]).raw()]
    if draft:  # split after page 2 (the walk's divergence), then after page 1 (the back-off)
        assert head.num_pages == 1 and head.next_token == 5
        assert head.children[TokenKey(a[4:8]).raw()].next_token == 9
    else:
        assert head.num_pages == 2 and head.next_token == 9
    # The cached key's end: its recorded continuation is 50.
    assert tree.match_prefix(TokenKey(a + [51])).device_len == (8 if draft else 12)


def test_node_end_inside_a_path_is_checked_too():
    """A node with two branches keeps the continuation it was computed with; the other branch backs off there."""
    tree = RadixCache(PS, draft_records=True)
    a = list(range(1, 9)) + [20, 21, 22, 23]
    b = list(range(1, 9)) + [30, 31, 32, 33]
    _one_rank_insert(tree, a, next_token=-1)
    m = tree.match_prefix(TokenKey(b + [0]))
    assert m.device_len == 4  # a's node ends after page 2 with continuation 20, b continues with 30
    _one_rank_insert(tree, b, next_token=-1, matched=1)  # b's pages 2.. go under the shared node
    shared = m.nodes[-1].children[TokenKey(list(range(5, 9))).raw()]
    assert shared.next_token == 20 and len(shared.children) == 2
    assert tree.match_prefix(TokenKey(b + [0])).device_len == 4  # b's branch is behind a's continuation
    assert tree.match_prefix(TokenKey(a + [0])).device_len == 8  # a's own end: continuation unknown (-1)
    with pytest.raises(ValueError, match="next_token"):
        _one_rank_insert(tree, a, next_token=-2)


@pytest.mark.parametrize("draft", [False, True])
def test_revived_node_takes_the_new_continuation_and_drops_a_stale_l2_copy_only_with_draft_records(draft):
    tree = RadixCache(PS, draft_records=draft)
    a = list(range(1, 9))
    res = _one_rank_insert(tree, a, next_token=40)
    node = res.last_node
    node.host_pages, node.host_payloads = np.arange(2), frozenset({("mla", 0)})
    assert tree.evict(2, lambda n: True) == 2  # stays as L2-only
    dropped = []
    res = tree.insert(TokenKey(a), np.arange(7, 9), np.zeros(2, np.int64), next_token=41, drop_host=dropped.append)
    assert res.revived_nodes == [node] and node.next_token == 41
    assert dropped == ([node] if draft else []) and (node.host_pages is None) == draft
