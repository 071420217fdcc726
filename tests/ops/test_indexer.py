"""Tests for the lightning-indexer ops (cpgraph/ops/indexer.py).

Every op is compared with a brute force written here with plain Python loops
(or the transformers DeepSeek-V3.2 indexer as an external oracle), never with
its own reference.  Top-k results are compared in a tie-robust way: a pick
is correct if it is a valid top-k *set* for the scores; exact set equality
is asserted only where the k-th and (k+1)-th scores are separated.  The tie
rule (equal scores: lower position first) is checked exactly against a
plain sort key on batches built to tie (few distinct values, integer
inputs, duplicated keys).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpgraph.ops.indexer as indexer
from cpgraph.plan import plan_prefill

ops = torch.ops.cpgraph
SETTINGS = settings(max_examples=25, deadline=None)
TIE_EPS = 1e-4


# ------------------------------------------------------------ brute forces
def brute_logits(q, k, w, ks, ke):
    """Python-loop scores: nested lists of floats, -inf outside the window."""
    M, H, D = q.shape
    N = k.shape[0]
    ql, kl, wl = q.double().tolist(), k.double().tolist(), w.double().tolist()
    out = []
    for s in range(M):
        row = []
        for t in range(N):
            if not int(ks[s]) <= t < int(ke[s]):
                row.append(-math.inf)
                continue
            acc = 0.0
            for h in range(H):
                dot = sum(ql[s][h][d] * kl[t][d] for d in range(D))
                acc += wl[s][h] * max(dot, 0.0)
            row.append(acc)
        out.append(row)
    return out


def e4m3_value(byte: int) -> float:
    """Decode one e4m3fn byte by its bit fields (1 sign, 4 exponent bias 7, 3 mantissa)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp = (byte >> 3) & 0xF
    man = byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * (man / 8.0) * 2.0**-6
    return sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)


def check_topk_row(picks, scores, lo, hi, topk, eps=TIE_EPS):
    """Assert ``picks`` (list, -1 padded) is a correct top-k of ``scores`` over window [lo, hi).

    Returns True if the row was decided without a tie at the boundary (the
    selected set is then unique and was checked exactly).
    """
    window = list(range(lo, hi))
    n_sel = min(len(window), topk)
    chosen = [p for p in picks if p != -1]
    assert picks[n_sel:] == [-1] * (topk - n_sel), f"padding must be -1 at the tail, got {picks}"
    assert len(chosen) == n_sel and len(set(chosen)) == n_sel, f"need {n_sel} distinct picks, got {picks}"
    assert all(lo <= p < hi for p in chosen), f"picks {chosen} outside window [{lo}, {hi})"
    vals = [scores[p] for p in chosen]
    assert chosen == sorted(chosen), "picks must be in position order"
    rest = [scores[t] for t in window if t not in set(chosen)]
    if rest:
        assert min(vals) >= max(rest) - eps, "an unselected key scores higher than a selected one"
    ranked = sorted((scores[t] for t in window), reverse=True)
    if len(ranked) > topk and ranked[topk - 1] - ranked[topk] < eps:
        return False
    if rest:
        assert set(chosen) == {t for t in window if scores[t] >= ranked[n_sel - 1]}
    return True


def random_windows(g, M, N, allow_empty=True):
    ks = torch.randint(0, N + 1, (M,), generator=g)
    span = torch.randint(0, N + 1, (M,), generator=g)
    ke = torch.minimum(ks + span, torch.full((M,), N))
    if not allow_empty:
        ke = torch.maximum(ke, torch.minimum(ks + 1, torch.full((M,), N)))
    return ks, ke


def scoring_inputs(seed, M=5, H=3, D=8, N=11, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(M, H, D, generator=g).to(dtype)
    k = torch.randn(N, D, generator=g).to(dtype)
    w = torch.randn(M, H, generator=g)
    ks, ke = random_windows(g, M, N)
    return q, k, w, ks, ke


def planned_batch(prefix, extend, cp, page, rank, H=3, D=8, seed=0, row_align=1):
    """Inputs on one rank of a planned batch; keys cover the full ragged view (slack rows included)."""
    plan = plan_prefill(prefix, extend, cp_size=cp, page_size=page, row_align=row_align)
    rp = plan.rank(rank)
    N = int(rp.kv_lens.sum())
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rp.num_rows, H, D, generator=g)
    k = torch.randn(N, D, generator=g)
    w = torch.rand(rp.num_rows, H, generator=g) + 0.1
    return plan, rp, q, k, w


# ---------------------------------------------------------- indexer_logits
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), M=st.integers(0, 5), H=st.integers(1, 4), D=st.integers(1, 9),
       N=st.integers(0, 9))
def test_indexer_logits_matches_loops(seed, M, H, D, N):
    q, k, w, ks, ke = scoring_inputs(seed, M, H, D, N)
    got = ops.indexer_logits(q, k, w, ks, ke)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    want = torch.tensor(brute_logits(q, k, w, ks, ke), dtype=torch.float64).view(M, N)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_indexer_logits_many_heads_and_half_inputs():
    # More heads than one accumulation group, bf16 inputs computed in fp32.
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 19, 6, generator=g).bfloat16()
    k = torch.randn(7, 6, generator=g).bfloat16()
    w = torch.randn(4, 19, generator=g)
    ks, ke = torch.tensor([0, 2, 3, 7]), torch.tensor([7, 5, 3, 7])
    got = ops.indexer_logits(q, k, w, ks, ke)
    want = torch.tensor(brute_logits(q, k, w, ks, ke), dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.isneginf(got[2]).all() and torch.isneginf(got[3]).all()  # empty windows


# ---------------------------------------------------------------- hadamard
def sylvester(d):
    return [[(-1.0) ** bin(i & j).count("1") for j in range(d)] for i in range(d)]


@pytest.mark.parametrize("d", [1, 2, 8, 32])
def test_hadamard_matches_sylvester_loops(d):
    x = torch.randn(3, 2, d, generator=torch.Generator().manual_seed(d))
    H = sylvester(d)
    xl = x.double().tolist()
    want = [[[sum(v[i] * H[i][j] for i in range(d)) / math.sqrt(d) for j in range(d)] for v in blk] for blk in xl]
    got = ops.hadamard(x)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-5)


def test_hadamard_preserves_dot_products_and_is_involution():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(6, 4, 128, generator=g)
    k = torch.randn(9, 128, generator=g)
    dots = torch.einsum("mhd,nd->mhn", q.double(), k.double())
    hd = torch.einsum("mhd,nd->mhn", ops.hadamard(q).double(), ops.hadamard(k).double())
    torch.testing.assert_close(hd, dots, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ops.hadamard(ops.hadamard(k)), k, rtol=1e-5, atol=1e-5)
    # And the indexer scores are unchanged by rotating both sides.
    w = torch.rand(6, 4, generator=g)
    ks, ke = torch.zeros(6, dtype=torch.int64), torch.full((6,), 9)
    torch.testing.assert_close(
        ops.indexer_logits(ops.hadamard(q), ops.hadamard(k), w, ks, ke),
        ops.indexer_logits(q, k, w, ks, ke), rtol=1e-4, atol=1e-4)


def test_hadamard_keeps_half_dtype():
    x = torch.randn(5, 16).bfloat16()
    y = ops.hadamard(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ops.hadamard(x.float()), rtol=1e-2, atol=1e-2)


# ----------------------------------------------------------- fp8 scoring
def test_indexer_q_quant_matches_loops():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 4, 16, generator=g) * torch.tensor([1e-6, 0.3, 7.0, 900.0]).view(1, 4, 1)
    w = torch.randn(3, 4, generator=g)
    q_bytes, w_q = ops.indexer_q_quant(q, w)
    assert q_bytes.dtype == torch.uint8 and q_bytes.shape == q.shape
    assert w_q.dtype == torch.float32 and w_q.shape == w.shape
    for s in range(3):
        for h in range(4):
            row = q[s, h].double().tolist()
            amax = max(abs(v) for v in row)
            scale = 2.0 ** math.ceil(math.log2(max(amax, 1e-4) / 448.0))
            assert w_q[s, h].item() == pytest.approx(float(w[s, h]) * scale, rel=1e-6)
            decoded = [e4m3_value(b) * scale for b in q_bytes[s, h].tolist()]
            for v, dv in zip(row, decoded):
                # e4m3 keeps 3 mantissa bits: error <= 2^-4 relative, or the subnormal step.
                assert abs(v - dv) <= max(abs(v) * 2.0**-4, scale * 2.0**-9) + 1e-12


def test_indexer_logits_fp8_matches_loops():
    g = torch.Generator().manual_seed(6)
    M, H, D, N = 4, 3, 8, 10
    q_bytes = torch.randint(0, 256, (M, H, D), generator=g, dtype=torch.uint8)
    k_bytes = torch.randint(0, 256, (N, D), generator=g, dtype=torch.uint8)
    q_bytes[(q_bytes & 0x7F) == 0x7F] = 0  # no NaN codes
    k_bytes[(k_bytes & 0x7F) == 0x7F] = 0
    k_scale = torch.exp2(torch.randint(-6, 3, (N,), generator=g).float())
    w = torch.randn(M, H, generator=g)
    ks, ke = random_windows(g, M, N)
    got = ops.indexer_logits_fp8(q_bytes, k_bytes, k_scale, w, ks, ke)
    qd = torch.tensor([[[e4m3_value(b) for b in hh] for hh in ss] for ss in q_bytes.tolist()], dtype=torch.float64)
    kd = torch.tensor([[e4m3_value(b) * float(k_scale[t]) for b in row] for t, row in enumerate(k_bytes.tolist())],
                      dtype=torch.float64)
    want = torch.tensor(brute_logits(qd, kd, w, ks, ke), dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-3)


def test_fp8_path_approximates_fp32_scores():
    """Production pipeline: Hadamard, q quant with folded scale, per-row ue8m0 key quant."""
    g = torch.Generator().manual_seed(7)
    M, H, D, N = 8, 4, 128, 40
    q = torch.randn(M, H, D, generator=g)
    k = torch.randn(N, D, generator=g)
    w = torch.rand(M, H, generator=g) * (H**-0.5 * D**-0.5)
    ks, ke = torch.zeros(M, dtype=torch.int64), torch.full((M,), N)
    qr, kr = ops.hadamard(q), ops.hadamard(k)
    q_bytes, w_q = ops.indexer_q_quant(qr, w)
    k_scale = indexer.ue8m0_scale(kr.abs().amax(-1))
    k_bytes = indexer.e4m3_bytes(kr, k_scale)
    fp8 = ops.indexer_logits_fp8(q_bytes, k_bytes, k_scale, w_q, ks, ke)
    ref = ops.indexer_logits(q, k, w, ks, ke)
    assert (fp8 - ref).abs().max() < 0.08 * ref.abs().max()
    # Most of the top-k survives quantisation.
    a = ops.topk_ragged(fp8, ks, ke, 10)
    b = ops.topk_ragged(ref, ks, ke, 10)
    overlap = sum(len(set(x) & set(y)) for x, y in zip(a.tolist(), b.tolist()))
    assert overlap >= 0.8 * M * 10


# ------------------------------------------------------------------ top-k
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), M=st.integers(0, 6), N=st.integers(0, 12), topk=st.integers(1, 8),
       ties=st.booleans())
def test_topk_ragged_matches_loops(seed, M, N, topk, ties):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(M, N, generator=g)
    if ties:
        logits = logits.round()  # many exact ties
    ks, ke = random_windows(g, M, N)
    got = ops.topk_ragged(logits, ks, ke, topk)
    assert got.dtype == torch.int32 and got.shape == (M, topk)
    for s in range(M):
        check_topk_row(got[s].tolist(), logits[s].tolist(), int(ks[s]), int(ke[s]), topk)


def test_topk_ignores_scores_outside_the_window():
    logits = torch.tensor([[100.0, 1.0, 2.0, 100.0, 3.0]])
    got = ops.topk_ragged(logits, torch.tensor([1]), torch.tensor([3]), 3)
    assert got.tolist() == [[1, 2, -1]]  # the window's best two, in position order


def _slot_map(plan, seed):
    """Physical slots of every full-view row: pages handed out in shuffled order."""
    N = int(plan.kv_lens.sum())
    ps = plan.page_size
    num_pages = N // ps
    perm = torch.randperm(num_pages + 3, generator=torch.Generator().manual_seed(seed))[:num_pages]
    t = torch.arange(N)
    return perm[t // ps] * ps + t % ps


@pytest.mark.parametrize("rank", [0, 1])
def test_topk_ragged_and_paged_on_planned_batch(rank):
    # Three requests, two with cached prefixes, page-tail slack, CP compute + static padding.
    prefix, extend, topk = [8, 0, 4], [5, 10, 3], 6
    plan, rp, q, k, w = planned_batch(prefix, extend, cp=2, page=4, rank=rank, row_align=4)
    assert rp.compute_padding + rp.static_padding > 0, "the batch must contain dummy rows"
    kv_slots = _slot_map(plan, seed=rank)
    logits = ops.indexer_logits(q, k, w, rp.ks, rp.ke)
    ragged = ops.topk_ragged(logits, rp.ks, rp.ke, topk)
    paged = ops.topk_paged(logits, rp.ks, rp.ke, topk, kv_slots)
    scores = brute_logits(q, k, w, rp.ks, rp.ke)
    differs = 0
    for s in range(rp.num_rows):
        r, p = ragged[s].tolist(), paged[s].tolist()
        if s >= rp.num_valid:
            assert r == [-1] * topk and p == [-1] * topk, "dummy rows select nothing"
            continue
        b, pos = int(rp.req_index[s]), int(rp.positions[s])
        lo = int(plan.kv_start[b])
        check_topk_row(r, scores[s], lo, lo + pos + 1, topk)  # window taken from the request, not ks/ke
        assert p == [int(kv_slots[t]) if t >= 0 else -1 for t in r]
        differs += r != p
    assert differs > 0, "the two coordinate spaces must differ on this batch"


# ---------------------------------------------------------------- tie rule
def brute_tie_rule(scores, lo, hi, topk):
    """Top-k of window [lo, hi) by the tie rule, written as a plain sort key.

    Higher score first; NaN above every number (all NaNs equal); -0.0 == 0.0
    (Python compares them equal); equal scores: lower column first.
    """
    def rank(t):
        v = scores[t]
        return (0, 0.0, t) if math.isnan(v) else (1, -v, t)

    picks = sorted(sorted(range(lo, hi), key=rank)[:topk])  # the rule's set, listed in position order
    return picks + [-1] * (topk - len(picks))


def tied_logits(g, M, N):
    """Scores full of exact ties: few distinct values, +-0.0, +-inf and NaN mixed in."""
    pool = torch.tensor([0.0, -0.0, 0.0, 1.0, -1.0, 0.5, 2.0, float("inf"), float("-inf"), float("nan")])
    pick = torch.randint(0, len(pool), (M, N), generator=g)
    return pool[pick]


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), M=st.integers(0, 6), N=st.integers(0, 16), topk=st.integers(1, 10))
def test_topk_tie_rule_matches_brute_force(seed, M, N, topk):
    g = torch.Generator().manual_seed(seed)
    logits = tied_logits(g, M, N)
    ks, ke = random_windows(g, M, N)
    slots = torch.randperm(N + 7, generator=g)[:N] * 3  # physical slots in no particular order
    ragged = ops.topk_ragged(logits, ks, ke, topk)
    paged = ops.topk_paged(logits, ks, ke, topk, slots)
    for s in range(M):
        want = brute_tie_rule(logits[s].tolist(), int(ks[s]), int(ke[s]), topk)
        assert ragged[s].tolist() == want, f"row {s}"
        assert paged[s].tolist() == [int(slots[t]) if t >= 0 else -1 for t in want], f"row {s}"


def test_tie_rule_negative_zero_and_nan_are_single_values():
    # -0.0 ties with 0.0 (position decides); NaN ranks first; -inf inside the window is still a key.
    logits = torch.tensor([[-0.0, 0.0, float("-inf"), float("nan"), -0.0, 1.0]])
    got = ops.topk_ragged(logits, torch.tensor([0]), torch.tensor([6]), 7)
    assert got.tolist() == [[0, 1, 2, 3, 4, 5, -1]]
    got = ops.topk_ragged(logits, torch.tensor([1]), torch.tensor([5]), 2)
    assert got.tolist() == [[1, 3]]  # NaN (3) and the first of the tied zeros (1)
    got = ops.topk_ragged(logits, torch.tensor([0]), torch.tensor([6]), 3)
    assert got.tolist() == [[0, 3, 5]]  # NaN, 1.0, then the lowest-position zero (-0.0 at 0)


def integer_tie_inputs(seed, M, H, D, N, dup=True):
    """Scoring inputs whose scores are exact in fp32 whatever the summation order, with many ties.

    Small integers everywhere (every product and partial sum is an exact
    integer), mixed-sign head weights, and duplicated key rows; ReLU zeros
    come from keys that every head dots negatively.
    """
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (M, H, D), generator=g).float()
    k = torch.randint(-2, 3, (N, D), generator=g).float()
    if dup and N > 1:
        src = torch.randint(0, N, (N,), generator=g)
        take = torch.rand(N, generator=g) < 0.4
        k = torch.where(take[:, None], k[src], k)
    w = torch.randint(-2, 3, (M, H), generator=g).float()
    return q, k, w


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), M=st.integers(1, 6), H=st.integers(1, 3), N=st.integers(1, 14),
       topk=st.integers(1, 9))
def test_indexer_topk_tie_rule_any_chunking(seed, M, H, N, topk):
    q, k, w = integer_tie_inputs(seed, M, H, 4, N)
    ks, ke = random_windows(torch.Generator().manual_seed(seed + 1), M, N)
    scores = brute_logits(q, k, w, ks, ke)
    want = [brute_tie_rule(scores[s], int(ks[s]), int(ke[s]), topk) for s in range(M)]
    for budget in (1, 4 * N, 4 * N * 2 + 3, 1 << 40):
        got = ops.indexer_topk(q, k, w, ks, ke, topk, budget)
        assert got.tolist() == want, f"budget {budget}"
    assert ops.topk_ragged(ops.indexer_logits(q, k, w, ks, ke), ks, ke, topk).tolist() == want


def test_tie_rule_same_on_every_cp_rank_as_on_one_device():
    """Each token's selection is the same whichever rank (and chunk of rows) computes it."""
    prefix, extend, topk, H, D = [8, 0, 4], [13, 10, 6], 5, 2, 4
    one = plan_prefill(prefix, extend, cp_size=1, page_size=4)
    N = int(one.kv_lens.sum())
    T = sum(extend)
    q_tok, k, w_tok = integer_tie_inputs(3, T, H, D, N)
    r1 = one.rank(0)
    single = ops.indexer_topk(q_tok[r1.token_index], k, w_tok[r1.token_index], r1.ks, r1.ke, topk, 1 << 30)
    by_token = {int(t): single[s].tolist() for s, t in enumerate(r1.token_index.tolist()) if t >= 0}
    ties = 0
    scores = brute_logits(q_tok[r1.token_index], k, w_tok[r1.token_index], r1.ks, r1.ke)
    for s in range(r1.num_valid):
        row = sorted(scores[s][int(r1.ks[s]) : int(r1.ke[s])], reverse=True)
        ties += len(row) > topk and row[topk - 1] == row[topk]
    assert ties >= 5, "the batch must tie at the top-k boundary"
    for cp in (2, 3):
        plan = plan_prefill(prefix, extend, cp_size=cp, page_size=4, row_align=4)
        assert list(plan.kv_start) == list(one.kv_start) and list(plan.kv_lens) == list(one.kv_lens)
        for r in range(cp):
            rp = plan.rank(r)
            tok = rp.token_index.clamp(min=0)
            got = ops.indexer_topk(q_tok[tok], k, w_tok[tok], rp.ks, rp.ke, topk, 4 * N * 2)
            for s, t in enumerate(rp.token_index.tolist()):
                assert got[s].tolist() == (by_token[t] if t >= 0 else [-1] * topk), f"cp {cp} rank {r} row {s}"


# --------------------------------------------------------------- indexer_topk
@pytest.mark.bitexact  # the budget chunks rows: GEMMs of other row counts than the unfused op's (docs/bitwise.md)
def test_indexer_topk_equals_unfused_and_ignores_budget():
    plan, rp, q, k, w = planned_batch([4, 0], [9, 6], cp=2, page=4, rank=1, H=5, D=8, row_align=4)
    N = k.shape[0]
    unfused = ops.topk_ragged(ops.indexer_logits(q, k, w, rp.ks, rp.ke), rp.ks, rp.ke, 4)
    for budget in (1, 4 * N, 4 * N * 3 + 7, 1 << 40):
        fused = ops.indexer_topk(q, k, w, rp.ks, rp.ke, 4, budget)
        assert torch.equal(fused, unfused), f"budget {budget}"


@pytest.mark.parametrize("budget_rows,expected_rows", [(0, 1), (1, 1), (3, 3), (1000, 1000)])
def test_indexer_topk_chunk_count_follows_budget(monkeypatch, budget_rows, expected_rows):
    M, N = 10, 13
    q, k, w, ks, ke = scoring_inputs(11, M=M, H=2, D=4, N=N)
    budget = max(1, 4 * N * budget_rows)
    assert indexer.logits_chunk_rows(N, budget) == expected_rows
    shapes = []
    real = indexer._masked_logits

    def spy(*args):
        out = real(*args)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(indexer, "_masked_logits", spy)
    ops.indexer_topk(q, k, w, ks, ke, 3, budget)
    assert len(shapes) == math.ceil(M / expected_rows)
    assert sum(r for r, _ in shapes) == M
    if budget_rows >= 1:
        assert all(r * n * 4 <= budget for r, n in shapes)


# ------------------------------------------------------ transformers oracle
def _hf_indexer(H, D, topk, hidden, seed):
    from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

    cfg = DeepseekV32Config(hidden_size=hidden, q_lora_rank=24, index_n_heads=H, index_head_dim=D,
                            qk_rope_head_dim=8, index_topk=topk, num_attention_heads=2,
                            num_key_value_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8)
    torch.manual_seed(seed)
    mod = DeepseekV32Indexer(cfg, layer_idx=0).float().eval()
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.3)
    return mod


@pytest.mark.bitexact  # fused in 2-row chunks against the unfused op's one GEMM (docs/bitwise.md)
def test_topk_sets_match_transformers_indexer():
    pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")
    H, D, topk, hidden = 4, 16, 5, 32
    extend = [7, 12, 5]
    mod = _hf_indexer(H, D, topk, hidden, seed=0)
    plan = plan_prefill([0, 0, 0], extend, cp_size=2, page_size=4, row_align=4)
    g = torch.Generator().manual_seed(1)
    T = sum(extend)
    hidden_states = torch.randn(T, hidden, generator=g)
    q_resid = torch.randn(T, 24, generator=g)

    # HF oracle, one request at a time (identity RoPE: cos=1, sin=0; we test scoring, not RoPE).
    hf_picks, starts = [], [0]
    for n in extend:
        starts.append(starts[-1] + n)
    with torch.no_grad():
        for b, n in enumerate(extend):
            sl = slice(starts[b], starts[b] + n)
            cos, sin = torch.ones(1, n, 8), torch.zeros(1, n, 8)
            causal = torch.ones(n, n, dtype=torch.bool).tril()[None]
            hf_picks.append(mod(hidden_states[None, sl], q_resid[None, sl], (cos, sin), causal, None)[0])
        # Same projections, our layout: q per token, keys over the full ragged view (slack rows random).
        q_tok = mod.wq_b(q_resid).view(T, H, D)
        k_tok = mod.k_norm(mod.wk(hidden_states))
        w_tok = mod.weights_proj(hidden_states) * (H**-0.5 * D**-0.5)
    N = int(plan.kv_lens.sum())
    k_view = torch.randn(N, D, generator=g) * 100  # slack rows would win if ever unmasked
    for b, n in enumerate(extend):
        k_view[int(plan.kv_start[b]) : int(plan.kv_start[b]) + n] = k_tok[starts[b] : starts[b] + n]

    compared = skipped = 0
    for r in range(2):
        rp = plan.rank(r)
        tok = rp.token_index.clamp(min=0)
        q, w = q_tok[tok], w_tok[tok]
        logits = ops.indexer_logits(q, k_view, w, rp.ks, rp.ke)
        ours = ops.topk_ragged(logits, rp.ks, rp.ke, topk)
        fused = ops.indexer_topk(q, k_view, w, rp.ks, rp.ke, topk, 4 * N * 2)
        assert torch.equal(ours, fused)
        for s in range(rp.num_rows):
            if s >= rp.num_valid:
                assert (ours[s] == -1).all()
                continue
            b, pos = int(rp.req_index[s]), int(rp.positions[s])
            base = int(plan.kv_start[b])
            hf = {int(t) + base for t in hf_picks[b][pos].tolist() if t <= pos}
            mine = {t for t in ours[s].tolist() if t >= 0}
            vals = sorted(logits[s, base : base + pos + 1].tolist(), reverse=True)
            if len(vals) > topk and vals[topk - 1] - vals[topk] < TIE_EPS:
                skipped += 1
                continue
            assert mine == hf, f"rank {r} row {s}: {sorted(mine)} vs HF {sorted(hf)}"
            compared += 1
    assert compared >= 0.8 * T and compared + skipped == T


# ------------------------------------------------------------------ opcheck
def _opcheck(op, args):
    torch.library.opcheck(op.default, args)


@pytest.mark.parametrize("seed,M,H,D,N", [(0, 4, 2, 8, 6), (1, 1, 3, 16, 9), (2, 7, 1, 4, 1)])
def test_opcheck_scoring_ops(seed, M, H, D, N):
    q, k, w, ks, ke = scoring_inputs(seed, M, H, D, N)
    _opcheck(ops.indexer_logits, (q, k, w, ks, ke))
    _opcheck(ops.indexer_logits, (q.bfloat16(), k.bfloat16(), w, ks.int(), ke.int()))
    q_bytes, w_q = ops.indexer_q_quant(q, w)
    _opcheck(ops.indexer_q_quant, (q, w))
    k_scale = indexer.ue8m0_scale(k.abs().amax(-1))
    k_bytes = indexer.e4m3_bytes(k, k_scale)
    _opcheck(ops.indexer_logits_fp8, (q_bytes, k_bytes, k_scale, w_q, ks, ke))
    _opcheck(ops.hadamard, (q,))
    _opcheck(ops.indexer_topk, (q, k, w, ks, ke, 3, 4 * N * 2))


@pytest.mark.parametrize("seed,M,N,topk", [(0, 4, 6, 2), (1, 3, 2, 5), (2, 6, 9, 9)])
def test_opcheck_topk_ops(seed, M, N, topk):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(M, N, generator=g)
    ks, ke = random_windows(g, M, N)
    _opcheck(ops.topk_ragged, (logits, ks, ke, topk))
    _opcheck(ops.topk_paged, (logits, ks, ke, topk, torch.randperm(N, generator=g) + 5))


# ------------------------------------------------------------------- errors
def _good():
    return scoring_inputs(0, M=3, H=2, D=8, N=5)


def test_error_bad_dtype():
    q, k, w, ks, ke = _good()
    with pytest.raises(ValueError, match="'weights'"):
        ops.indexer_logits(q, k, w.bfloat16(), ks, ke)
    with pytest.raises(ValueError, match="'ks'"):
        ops.indexer_logits(q, k, w, ks.float(), ke)
    with pytest.raises(ValueError, match="'q'"):
        ops.indexer_logits(q.int(), k, w, ks, ke)
    with pytest.raises(ValueError, match="'q_bytes'"):
        ops.indexer_logits_fp8(q, k.byte(), torch.ones(5), w, ks, ke)
    with pytest.raises(ValueError, match="'logits'"):
        ops.topk_ragged(torch.zeros(3, 5, dtype=torch.float64), ks, ke, 2)
    with pytest.raises(ValueError, match="'kv_slots'"):
        ops.topk_paged(torch.zeros(3, 5), ks, ke, 2, torch.arange(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="'x'"):
        ops.hadamard(torch.zeros(4, dtype=torch.int64))


def test_error_bad_rank():
    q, k, w, ks, ke = _good()
    with pytest.raises(ValueError, match="'q'"):
        ops.indexer_logits(q[0], k, w, ks, ke)
    with pytest.raises(ValueError, match="'k'"):
        ops.indexer_topk(q, k[None], w, ks, ke, 2, 1024)
    with pytest.raises(ValueError, match="'logits'"):
        ops.topk_ragged(torch.zeros(5), ks, ke, 2)
    with pytest.raises(ValueError, match="'x'"):
        ops.hadamard(torch.zeros(()))


def test_error_bad_shape():
    q, k, w, ks, ke = _good()
    with pytest.raises(ValueError, match="'k'"):
        ops.indexer_logits(q, k[:, :4], w, ks, ke)
    with pytest.raises(ValueError, match="'weights'"):
        ops.indexer_q_quant(q, w[:, :1])
    with pytest.raises(ValueError, match="'ke'"):
        ops.indexer_logits(q, k, w, ks, ke[:2])
    with pytest.raises(ValueError, match="'k_scale'"):
        ops.indexer_logits_fp8(q.byte(), k.byte(), torch.ones(4), w, ks, ke)
    with pytest.raises(ValueError, match="'kv_slots'"):
        ops.topk_paged(torch.zeros(3, 5), ks, ke, 2, torch.arange(4))
    with pytest.raises(ValueError, match="power of two"):
        ops.hadamard(torch.zeros(2, 12))
    with pytest.raises(ValueError, match="'q'"):
        ops.indexer_q_quant(torch.zeros(2, 1, 256), torch.zeros(2, 1))


def test_error_bad_scalar_arguments():
    q, k, w, ks, ke = _good()
    with pytest.raises(ValueError, match="'topk'"):
        ops.topk_ragged(torch.zeros(3, 5), ks, ke, 0)
    with pytest.raises(ValueError, match="'max_logits_bytes'"):
        ops.indexer_topk(q, k, w, ks, ke, 2, 0)


def test_error_device_mix():
    q, k, w, ks, ke = _good()
    with pytest.raises(ValueError, match="one device"):
        ops.indexer_logits(q, k.to("meta"), w, ks, ke)
    with pytest.raises(ValueError, match="one device"):
        ops.topk_paged(torch.zeros(3, 5), ks, ke, 2, torch.arange(5, device="meta"))
    with pytest.raises(ValueError, match="one device"):
        ops.indexer_q_quant(q, w.to("meta"))


def test_debug_range_check(monkeypatch):
    q, k, w, ks, ke = _good()
    monkeypatch.setenv("CPGRAPH_DEBUG", "1")
    with pytest.raises(ValueError, match="'ke'"):
        ops.indexer_logits(q, k, w, ks, torch.full((3,), 6))
    with pytest.raises(ValueError, match="ke - ks"):
        ops.topk_ragged(torch.zeros(3, 5), torch.full((3,), 3), torch.full((3,), 2), 2)


# ------------------------------------------------------- indexer_topk (FP8)
def fp8_tie_inputs(seed, M, H, D, N):
    """e4m3 bytes of small integers and power-of-two key scales: exact scores that tie often."""
    q, k, w = integer_tie_inputs(seed, M, H, D, N)
    g = torch.Generator().manual_seed(seed + 7)
    k_scale = torch.exp2(torch.randint(-2, 2, (N,), generator=g).float())
    q_bytes = q.to(torch.float8_e4m3fn).view(torch.uint8)
    k_bytes = k.to(torch.float8_e4m3fn).view(torch.uint8)
    return q_bytes, k_bytes, k_scale, w


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), M=st.integers(1, 6), H=st.integers(1, 3), N=st.integers(1, 14),
       topk=st.integers(1, 9))
def test_indexer_topk_fp8_equals_unfused_any_chunking(seed, M, H, N, topk):
    q_bytes, k_bytes, k_scale, w = fp8_tie_inputs(seed, M, H, 4, N)
    ks, ke = random_windows(torch.Generator().manual_seed(seed + 1), M, N)
    q_val = torch.tensor([e4m3_value(b) for b in q_bytes.flatten().tolist()]).view(q_bytes.shape)
    k_val = torch.tensor([e4m3_value(b) for b in k_bytes.flatten().tolist()]).view(k_bytes.shape)
    scores = brute_logits(q_val, k_val * k_scale[:, None], w, ks, ke)
    want = [brute_tie_rule(scores[s], int(ks[s]), int(ke[s]), topk) for s in range(M)]
    unfused = ops.topk_ragged(ops.indexer_logits_fp8(q_bytes, k_bytes, k_scale, w, ks, ke), ks, ke, topk)
    assert unfused.tolist() == want
    for budget in (1, 4 * N, 4 * N * 2 + 3, 1 << 40):
        got = ops.indexer_topk(q_bytes, k_bytes, w, ks, ke, topk, budget, k_scale)
        assert got.tolist() == want, f"budget {budget}"


@pytest.mark.parametrize("budget_rows,expected_rows", [(0, 1), (2, 2), (1000, 1000)])
def test_indexer_topk_fp8_chunks_are_bounded(monkeypatch, budget_rows, expected_rows):
    """The FP8 form never scores more than a budget's worth of rows at once (the model's memory bound)."""
    M, N = 9, 13
    q_bytes, k_bytes, k_scale, w = fp8_tie_inputs(4, M, 2, 4, N)
    ks, ke = random_windows(torch.Generator().manual_seed(5), M, N)
    budget = max(1, 4 * N * budget_rows)
    shapes = []
    real = indexer._masked_logits

    def spy(*args):
        out = real(*args)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(indexer, "_masked_logits", spy)
    ops.indexer_topk(q_bytes, k_bytes, w, ks, ke, 3, budget, k_scale)
    assert len(shapes) == math.ceil(M / expected_rows) and sum(r for r, _ in shapes) == M
    assert all(r == min(expected_rows, M) or r == M % expected_rows for r, _ in shapes)
    if budget_rows >= 1:
        assert all(r * n * 4 <= budget for r, n in shapes)


@pytest.mark.parametrize("seed,M,H,D,N", [(0, 4, 2, 8, 6), (1, 1, 3, 16, 9), (2, 7, 1, 4, 1)])
def test_opcheck_indexer_topk_fp8(seed, M, H, D, N):
    q, k, w, ks, ke = scoring_inputs(seed, M, H, D, N)
    q_bytes, w_q = ops.indexer_q_quant(q, w)
    k_scale = indexer.ue8m0_scale(k.abs().amax(-1))
    k_bytes = indexer.e4m3_bytes(k, k_scale)
    _opcheck(ops.indexer_topk, (q_bytes, k_bytes, w_q, ks, ke, 3, 4 * N * 2, k_scale))
    _opcheck(ops.indexer_topk, (q_bytes, k_bytes, w_q, ks.int(), ke.int(), 5, 1, k_scale))


def test_indexer_topk_fp8_errors():
    q, k, w, ks, ke = _good()
    q_bytes, w_q = ops.indexer_q_quant(q, w)
    k_scale = indexer.ue8m0_scale(k.abs().amax(-1))
    k_bytes = indexer.e4m3_bytes(k, k_scale)
    with pytest.raises(ValueError, match="indexer_topk: argument 'q'"):
        ops.indexer_topk(q, k_bytes, w_q, ks, ke, 2, 1024, k_scale)  # float q with key scales
    with pytest.raises(ValueError, match="indexer_topk: argument 'k_scale'"):
        ops.indexer_topk(q_bytes, k_bytes, w_q, ks, ke, 2, 1024, k_scale[:-1])
    with pytest.raises(ValueError, match="indexer_topk: argument 'q'"):
        ops.indexer_topk(q_bytes, k.float(), w_q, ks, ke, 2, 1024)  # bytes without key scales
    with pytest.raises(ValueError, match="max_logits_bytes"):
        ops.indexer_topk(q_bytes, k_bytes, w_q, ks, ke, 2, 0, k_scale)


def test_debug_check_rejects_non_positive_key_scales(monkeypatch):
    q_bytes, k_bytes, k_scale, w = fp8_tie_inputs(6, 3, 2, 4, 5)
    ks, ke = torch.zeros(3, dtype=torch.long), torch.full((3,), 5)
    bad = k_scale.clone()
    bad[2] = -1.0
    ops.indexer_topk(q_bytes, k_bytes, w, ks, ke, 2, 1024, bad)  # unchecked without CPGRAPH_DEBUG
    monkeypatch.setenv("CPGRAPH_DEBUG", "1")
    with pytest.raises(ValueError, match="'k_scale' must be positive"):
        ops.indexer_topk(q_bytes, k_bytes, w, ks, ke, 2, 1024, bad)
    with pytest.raises(ValueError, match="'k_scale' must be positive"):
        ops.indexer_logits_fp8(q_bytes, k_bytes, bad, w, ks, ke)
    ops.indexer_topk(q_bytes, k_bytes, w, ks, ke, 2, 1024, k_scale)
