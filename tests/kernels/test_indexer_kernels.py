"""Triton indexer kernels (cpgraph/kernels/indexer*.py, topk_select.py) against the torch references.

Small shapes run on CPU tensors under ``TRITON_INTERPRET=1`` (CI) or on CUDA;
the production-shape tests at the bottom are marked ``gpu`` and need CUDA.

What must hold exactly: the selection under the tie rule (same ids in
position order, RAGGED and PAGED), whatever the row chunking, key tiling,
key splits, sample size, scratch size or bracket (a missed bracket and an
overflowing scratch take slower exact paths); dummy windows give ``-1``; a row's ids depend only on its own
inputs.  Scores are fp32 sums in a different order than the reference, so
they match to rounding; the top-k built on them is compared exactly where
scores are exact (small-integer inputs), and elsewhere as sets whose
disagreements must be ties within fp32 rounding (checked on the scores).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import cpgraph.ops.indexer as ix
from cpgraph.kernels import indexer as ki

ops = torch.ops.cpgraph


def _device():
    if os.environ.get("TRITON_INTERPRET", "") == "1":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


DEV = _device()
if DEV is None:
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA device", allow_module_level=True)

NAN, INF = float("nan"), float("inf")
# Hopper's FP8 tensor cores add each group of 32 products at reduced precision (the kernel then
# accumulates the groups in fp32, as the production FP8 kernels do); the reference sums exactly.
FP8_TOL = 2e-3


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@contextlib.contextmanager
def select_tuning(**values):
    """Selection tuning for one block of a test, restored after (tuning never changes results).

    Under the interpreter the fused-op tests below run with a 16-key sample (``SHORT_SAMPLE``;
    on a GPU they keep the default): each row program sorts its sample (a bitonic network of
    ~log2(S)^2 / 2 vectorised steps, 36 at the interpreter's default S = 256 and 10 at S = 16),
    which is most of a short row's cost.  The sample sizes themselves (16, 64, 1024 i.e. the
    interpreter's cap of 256, more or fewer than the window) are the subject of the selection
    tests and the FP8 fused test.
    """
    saved = ki.tuning()
    try:
        ki.set_tuning(**values)
        yield
    finally:
        ki.set_tuning(**saved)


SHORT_SAMPLE = dict(SELECT_SAMPLE=16) if DEV == "cpu" else {}


def windows(g, M, N, empty_every=4):
    ks = torch.randint(0, N + 1, (M,), generator=g)
    ke = torch.minimum(ks + torch.randint(0, N + 1, (M,), generator=g), torch.full((M,), N))
    ks[::empty_every] = ke[::empty_every]  # dummy rows
    return ks.to(DEV), ke.to(DEV)


def tied_scores(g, M, N, subnormals=False):
    pool = [0.0, -0.0, 0.0, 0.0, 1.0, -1.0, 0.25, 3.0, INF, -INF, NAN]
    if subnormals:  # the smallest subnormals of each sign, and a larger one: a flushing compare would tie them with 0
        pool += [1e-45, -1e-45, 3e-39, -3e-39]
    pool = torch.tensor(pool)
    return pool[torch.randint(0, len(pool), (M, N), generator=g)].to(DEV)


def integer_inputs(seed, M, H, D, N, dtype=torch.bfloat16):
    """Small-integer q/k/w with duplicated keys: every score is exact in fp32, ties are many."""
    g = _gen(seed)
    q = torch.randint(-2, 3, (M, H, D), generator=g).float()
    k = torch.randint(-2, 3, (N, D), generator=g).float()
    dup = torch.rand(N, generator=g) < 0.4
    k = torch.where(dup[:, None], k[torch.randint(0, N, (N,), generator=g)], k)
    w = torch.randint(-2, 3, (M, H), generator=g).float()
    return q.to(dtype).to(DEV), k.to(dtype).to(DEV), w.to(DEV)


# ---------------------------------------------------------------- selection
@pytest.mark.parametrize("topk", [1, 5, 16, 40])
@pytest.mark.parametrize("sample,float_pass,list_step", [(16, False, False), (64, False, False), (16, True, False),
                                                         (16, False, True), (16, True, True)])
def test_select_equals_reference_on_ties(topk, sample, float_pass, list_step):
    """``float_pass``: the window pass compares fp32 scores with the bracket (signed zeros, infinities, NaN and
    subnormals must order as their rank bits do); ``list_step``: the refinement and the collection walk the list
    one entry a thread (topk 40 > N: every window is copied whole)."""
    g = _gen(topk)
    M, N = 10, 37
    logits = tied_scores(g, M, N, subnormals=float_pass)
    ks, ke = windows(g, M, N)
    slots = (torch.randperm(N + 5, generator=g)[:N] * 7).to(DEV)
    saved = ki.tuning()
    try:
        ki.set_tuning(SELECT_SAMPLE=sample, SELECT_FLOAT_PASS=float_pass, SELECT_LIST_STEP=list_step)
        assert torch.equal(ki.topk_ragged(logits, ks, ke, topk), ix.topk_ragged_reference(logits, ks, ke, topk))
        assert torch.equal(ki.topk_paged(logits, ks, ke, topk, slots),
                           ix.topk_paged_reference(logits, ks, ke, topk, slots))
    finally:
        ki.set_tuning(**saved)


def _hard_rows(g, N, sample):
    """Rows that stress each path: heavy ties, one boundary value over many blocks, negatives, signed zeros,
    scores sorted by position (a strided sample still brackets them), NaN/inf, one constant (a bracket of
    one value), and keys large exactly where the sample looks (row 8, window [0, N)): the bracket misses
    and the exact fallback runs."""
    logits = torch.randn(9, N, generator=g)
    logits[1] = logits[1].round()
    logits[2, 100:] = 0.5
    logits[3] = -logits[3].abs()
    logits[4, ::3] = -0.0
    logits[5] = torch.linspace(-3, 3, N)
    logits[6, 7], logits[6, 11], logits[6, 13] = NAN, INF, -INF
    logits[7] = 2.0
    logits[8] = 0.0
    logits[8, (torch.arange(sample) * N) // sample] = 10.0 + torch.arange(sample).float()
    return logits


@pytest.mark.parametrize("block,sample,cols,paged,prefetch,float_pass,list_step",
                         [(64, 16, None, True, False, False, False), (128, 64, None, False, False, False, False),
                          (64, 16, 1, False, False, False, False), (64, 16, None, True, True, False, False),
                          (64, 16, None, True, False, True, False), (64, 16, 1, False, False, True, False),
                          (64, 16, None, True, True, False, True), (64, 16, 1, False, False, True, True)])
def test_select_multi_block(block, sample, cols, paged, prefetch, float_pass, list_step):
    """Windows many blocks long: the bracket pass, the 32-bin refinement and the ordered tie collection cross
    blocks; ``cols`` shrinks the candidate scratch (to its one-column minimum) so refinement reads the
    window itself.

    Interpreter cost is per block step (each pass walks the window a block at a time), so the blocks
    are 64 and 128 keys: 3 to 5 blocks over the 300-key windows.  PAGED differs from RAGGED only in
    the value the collection writes (the slot of a position, whatever the bracket and refinement
    did), so it runs on one configuration, over every row.  ``prefetch`` loads each block of the window
    pass one step ahead (the last prefetch lies past the window: masked); ``float_pass`` runs that pass on
    fp32 compares in 32-key steps, four a round (several rounds over these windows); ``list_step`` walks the
    list one entry a thread (:func:`test_select_list_step_rounds` covers its rounds)."""
    g = _gen(block + sample)
    N, topk = 300, 24
    logits = _hard_rows(g, N, sample).to(DEV)
    M = logits.shape[0]
    ks = torch.tensor([0, 5, 0, 17, 0, 250, 0, 3, 0], device=DEV)
    ke = torch.tensor([300, 290, 300, 299, 300, 300, 300, 280, 300], device=DEV)
    scratch = None if cols is None else torch.empty((M, cols), dtype=torch.int32, device=DEV)
    out = torch.full((M, topk), -7, dtype=torch.int32, device=DEV)
    ki.select_rows(logits, ks, ke, out, 0, M, topk, block=block, sample=sample, scratch=scratch, prefetch=prefetch,
                   float_pass=float_pass, list_step=list_step)
    assert torch.equal(out, ix.topk_ragged_reference(logits, ks, ke, topk))
    if not paged:
        return
    slots = torch.randperm(N, generator=g).to(DEV) + 1000
    ki.select_rows(logits, ks, ke, out, 0, M, topk, slots, block=block, sample=sample, scratch=scratch,
                   prefetch=prefetch, float_pass=float_pass, list_step=list_step)
    assert torch.equal(out, ix.topk_paged_reference(logits, ks, ke, topk, slots))


@pytest.mark.parametrize("float_pass,list_step", [(False, False), (True, False), (True, True)])
def test_select_subnormal_scores(float_pass, list_step):
    """Subnormals of both signs and signed zeros where the bracket's bounds fall: a compare that flushed
    subnormals to zero would tie keys the rank bits order (a too-short list only falls back to the exact
    path, but a wrong count above the bracket picks wrong keys).  Top-k 100 of 300 with a 64-key sample puts
    the upper bound inside the sample, on a subnormal or zero."""
    g = _gen(5)
    N, topk = 300, 100
    levels = torch.tensor([3e-39, 2e-44, 1e-44, 2e-45, 1e-45, 0.0, -0.0, -1e-45, -3e-39])
    rows = []
    for weights in ([1, 1, 1, 2, 2, 2, 1, 1, 1], [0, 0, 1, 1, 4, 3, 2, 1, 0], [0, 0, 0, 0, 3, 2, 2, 3, 2],
                    [1, 2, 2, 2, 1, 1, 1, 0, 0]):
        rows.append(levels[torch.multinomial(torch.tensor(weights, dtype=torch.float), N, True, generator=g)])
    logits = torch.stack(rows).to(DEV)
    M = logits.shape[0]
    ks = torch.tensor([0, 3, 0, 20], device=DEV)
    ke = torch.tensor([300, 300, 290, 300], device=DEV)
    out = torch.full((M, topk), -7, dtype=torch.int32, device=DEV)
    ki.select_rows(logits, ks, ke, out, 0, M, topk, block=64, sample=64, float_pass=float_pass, list_step=list_step)
    assert torch.equal(out, ix.topk_ragged_reference(logits, ks, ke, topk))


@pytest.mark.parametrize("float_pass,paged,cols", [(False, True, None), (True, False, None), (False, False, 840)])
def test_select_list_step_rounds(float_pass, paged, cols):
    """The list walks one entry a thread (``list_step``) over several rounds: one warp makes 32-entry steps, four a
    round, and these lists hold 280 to 600 entries, so rounds end part-way, ties of the k-th key cross steps and
    rounds (rows 1, 2 and the all-equal row 7), and the refinement's copy spans rounds.  Against the reference,
    PAGED included, and against the BLOCK form: the same list and the same compaction copy in the scratch, to the
    entry.  ``cols`` 840 (420 entries): some rows' lists fit with no room for the copy (no compaction), the longest
    overflow (the window paths, which ``list_step`` leaves as they are).
    """
    g = _gen(21)
    N, topk, sample = 600, 100, 16
    logits = _hard_rows(g, N, sample).to(DEV)
    M = logits.shape[0]
    ks = torch.tensor([0, 5, 0, 17, 0, 250, 0, 3, 0], device=DEV)
    ke = torch.tensor([600, 590, 600, 599, 600, 600, 600, 580, 600], device=DEV)
    slots = (torch.randperm(N, generator=g) + 1000).to(DEV) if paged else None
    want = (ix.topk_paged_reference(logits, ks, ke, topk, slots) if paged
            else ix.topk_ragged_reference(logits, ks, ke, topk))
    scratch = {}
    for list_step in (True, False):
        scratch[list_step] = torch.full((M, cols or 2 * N), -1, dtype=torch.int32, device=DEV)
        out = torch.full((M, topk), -7, dtype=torch.int32, device=DEV)
        ki.select_rows(logits, ks, ke, out, 0, M, topk, slots, block=64, sample=sample, num_warps=1,
                       scratch=scratch[list_step], float_pass=float_pass, list_step=list_step)
        assert torch.equal(out, want), f"list_step={list_step}"
    assert torch.equal(scratch[True], scratch[False])


def test_select_list_step_needs_fewer_than_8_warps():
    """A round's four step counts share an int32 a byte each: 32 x warps must stay below 256."""
    logits = torch.zeros(2, 8, device=DEV)
    ks, ke = torch.zeros(2, dtype=torch.int64, device=DEV), torch.full((2,), 8, device=DEV)
    out = torch.empty((2, 3), dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="list_step needs fewer than 8 warps"):
        ki.select_rows(logits, ks, ke, out, 0, 2, 3, num_warps=8, list_step=True)


@pytest.mark.parametrize("compact", [False, True])
def test_select_refinement_compaction(compact):
    """The refinement's copy of the first digit's candidates (``compact``) gives the reference's ids, and it runs:
    with a roomy scratch the rank-bit column holds entries past the list only when compacting."""
    g = _gen(11)
    N, topk, sample = 300, 24, 16
    logits = torch.randn(4, N, generator=g)
    logits[1] = logits[1].round(decimals=1)  # ties inside the bracket
    logits = logits.to(DEV)
    M = logits.shape[0]
    ks = torch.tensor([0, 0, 9, 40], device=DEV)
    ke = torch.tensor([300, 300, 290, 300], device=DEV)
    cap = N
    scratch = torch.full((M, 2 * cap), -1, dtype=torch.int32, device=DEV)
    out = torch.full((M, topk), -7, dtype=torch.int32, device=DEV)
    ki.select_rows(logits, ks, ke, out, 0, M, topk, block=64, sample=sample, scratch=scratch, compact=compact)
    assert torch.equal(out, ix.topk_ragged_reference(logits, ks, ke, topk))
    written = (scratch[:, :cap] != -1).sum(dim=1)
    plain = torch.full_like(scratch, -1)
    ki.select_rows(logits, ks, ke, out, 0, M, topk, block=64, sample=sample, scratch=plain, compact=False)
    listed = (plain[:, :cap] != -1).sum(dim=1)
    if compact:
        assert bool((written > listed).any())
    else:
        assert torch.equal(written, listed)


def test_select_scratch_is_checked():
    logits = torch.zeros(2, 8, device=DEV)
    ks, ke = torch.zeros(2, dtype=torch.int64, device=DEV), torch.full((2,), 8, device=DEV)
    out = torch.empty((2, 3), dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="scratch must be int32"):
        ki.select_rows(logits, ks, ke, out, 0, 2, 3, scratch=torch.empty((1, 4), dtype=torch.int32, device=DEV))


def test_select_clamps_bad_windows():
    """Out-of-range ks/ke never address memory outside the row (clamped into [0, N])."""
    logits = torch.arange(8, dtype=torch.float32, device=DEV).view(1, 8).repeat(3, 1)
    ks = torch.tensor([-5, 6, 3], device=DEV)
    ke = torch.tensor([2, 100, 1], device=DEV)
    got = ki.topk_ragged(logits, ks, ke, 3)
    assert got.tolist() == [[0, 1, -1], [6, 7, -1], [-1, -1, -1]]


# ------------------------------------------------------------------ scoring
@pytest.mark.parametrize("H,D,dtype", [(1, 8, torch.float32), (3, 16, torch.bfloat16), (64, 128, torch.bfloat16),
                                       (5, 24, torch.float16)])
def test_scoring_matches_reference(H, D, dtype):
    g = _gen(H * 100 + D)
    M, N = 7, 90
    q = torch.randn(M, H, D, generator=g).to(dtype).to(DEV)
    k = torch.randn(N, D, generator=g).to(dtype).to(DEV)
    w = torch.randn(M, H, generator=g).to(DEV)
    ks, ke = windows(g, M, N, empty_every=5)
    want = ix.indexer_logits_reference(q, k, w, ks, ke)
    got = ki.indexer_logits(q, k, w, ks, ke)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5 * float(want[fin].abs().max()))


@pytest.mark.parametrize("rows_per_block,key_tile,splits,keys_m", [(1, 16, 1, False), (4, 32, 3, False),
                                                                    (8, 64, 2, True), (1, 32, 1, True)])
def test_scoring_tiles_and_key_splits_do_not_change_scores(rows_per_block, key_tile, splits, keys_m):
    q, k, w = integer_inputs(5, 9, 4, 32, 150)
    ks, ke = windows(_gen(6), 9, 150, empty_every=4)
    out = torch.full((9, 150), -INF, device=DEV)
    ki.score_rows(q, k, w, ks, ke, out, 0, 9, rows_per_block=rows_per_block, key_tile=key_tile, splits=splits,
                  keys_m=keys_m)
    assert torch.equal(out, ix.indexer_logits_reference(q, k, w, ks, ke))  # exact: integer scores


def test_scoring_fp8_matches_reference():
    g = _gen(8)
    M, H, D, N = 5, 4, 64, 70
    q_bytes = torch.randint(0, 256, (M, H, D), generator=g, dtype=torch.uint8)
    k_bytes = torch.randint(0, 256, (N, D), generator=g, dtype=torch.uint8)
    q_bytes[(q_bytes & 0x7F) == 0x7F] = 0  # no NaN codes
    k_bytes[(k_bytes & 0x7F) == 0x7F] = 0
    k_scale = torch.exp2(torch.randint(-6, 3, (N,), generator=g).float())
    w = torch.randn(M, H, generator=g)
    q_bytes, k_bytes, k_scale, w = (t.to(DEV) for t in (q_bytes, k_bytes, k_scale, w))
    ks, ke = windows(g, M, N, empty_every=3)
    want = ix.indexer_logits_fp8_reference(q_bytes, k_bytes, k_scale, w, ks, ke)
    got = ki.indexer_logits_fp8(q_bytes, k_bytes, k_scale, w, ks, ke)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    fin = torch.isfinite(want)
    tol = FP8_TOL if DEV == "cuda" else 1e-5
    torch.testing.assert_close(got[fin], want[fin], rtol=tol, atol=tol * float(want[fin].abs().max()))


@pytest.mark.parametrize("keys_m,group", [(False, 32), (True, 0)])
def test_scoring_fp8_exact_on_integers_any_layout(keys_m, group):
    """Small-integer e4m3 operands and power-of-two key scales: every FP8 score is exact, whatever the layout."""
    g = _gen(12)
    M, H, D, N = 6, 4, 32, 80
    q = torch.randint(-3, 4, (M, H, D), generator=g).float()
    k = torch.randint(-3, 4, (N, D), generator=g).float()
    k_scale = torch.exp2(torch.randint(-3, 3, (N,), generator=g).float())
    w = torch.randint(-2, 3, (M, H), generator=g).float()
    q_bytes = q.to(torch.float8_e4m3fn).view(torch.uint8).to(DEV)
    k_bytes = k.to(torch.float8_e4m3fn).view(torch.uint8).to(DEV)
    k_scale, w = k_scale.to(DEV), w.to(DEV)
    ks, ke = windows(g, M, N, empty_every=4)
    want = ix.indexer_logits_fp8_reference(q_bytes, k_bytes, k_scale, w, ks, ke)
    out = torch.full((M, N), -INF, device=DEV)
    f8 = torch.float8_e4m3fn
    ki.score_rows(q_bytes.view(f8), k_bytes.view(f8), w, ks, ke, out, 0, M, k_scale=k_scale, keys_m=keys_m,
                  fp8_group=group)
    assert torch.equal(out, want)


# ------------------------------------------------------------------- fused
@pytest.mark.parametrize("sample", [16, 1024])
def test_indexer_topk_fp8_exact_any_budget(sample):
    """The FP8 form of the fused op: equal to the unfused FP8 reference on exact, tie-heavy scores, any chunking.

    Every budget runs with the 16-key sample; the large sample (1024, the interpreter's 256: more keys
    than any window) runs once, chunked (4 rows a chunk and a last chunk of one): a row's selection
    reads only its own scores, so which chunk it lands in cannot interact with the sample size."""
    g = _gen(31)
    M, H, D, N, topk = 9, 2, 32, 70, 7
    q = torch.randint(-2, 3, (M, H, D), generator=g).float()
    k = torch.randint(-2, 3, (N, D), generator=g).float()
    k = torch.where((torch.rand(N, generator=g) < 0.4)[:, None], k[torch.randint(0, N, (N,), generator=g)], k)
    k_scale = torch.exp2(torch.randint(-1, 2, (N,), generator=g).float()).to(DEV)
    w = torch.randint(-2, 3, (M, H), generator=g).float().to(DEV)
    q_bytes = q.to(torch.float8_e4m3fn).view(torch.uint8).to(DEV)
    k_bytes = k.to(torch.float8_e4m3fn).view(torch.uint8).to(DEV)
    ks, ke = windows(g, M, N, empty_every=5)
    logits = ix.indexer_logits_fp8_reference(q_bytes, k_bytes, k_scale, w, ks, ke)
    want = ix.topk_ragged_reference(logits, ks, ke, topk)
    assert torch.equal(ix.indexer_topk_reference(q_bytes, k_bytes, w, ks, ke, topk, 4 * N * 2, k_scale), want)
    with select_tuning(SELECT_SAMPLE=sample):
        for budget in (1, 4 * N * 4, 1 << 30) if sample == 16 else (4 * N * 4,):
            got = ki.indexer_topk(q_bytes, k_bytes, w, ks, ke, topk, budget, k_scale)
            assert torch.equal(got, want), f"budget {budget}"


@pytest.mark.parametrize("H", [1, 2, 8])
def test_indexer_topk_exact_on_integer_ties_any_budget(H):
    M, D, N, topk = 8, 16, 60, 9
    q, k, w = integer_inputs(H, M, H, D, N)
    ks, ke = windows(_gen(H + 1), M, N, empty_every=5)
    want = ix.indexer_topk_reference(q, k, w, ks, ke, topk, 1 << 30)
    with select_tuning(**SHORT_SAMPLE):
        for budget in (1, 4 * N * 5, 1 << 30):  # 1 row, 5 rows, everything per chunk
            assert torch.equal(ki.indexer_topk(q, k, w, ks, ke, topk, budget), want), f"budget {budget}"


def test_row_result_independent_of_batch_composition():
    """A row's ids depend on its own q, w and window only: same rows in other batches, other positions.

    Integer inputs (exact scores, many ties): the interpreter's tile height follows the row count, so
    with random inputs equality would rest on numpy's GEMM being row-invariant (docs/bitwise.md); the
    GPU tiles do not depend on it (``test_gpu_row_local_and_cuda_graph`` checks random inputs there)."""
    M, H, D, N, topk = 8, 4, 32, 80, 10
    q, k, w = integer_inputs(21, M, H, D, N)
    g = _gen(22)
    ks, ke = windows(g, M, N, empty_every=6)
    with select_tuning(**SHORT_SAMPLE):
        base = ki.indexer_topk(q, k, w, ks, ke, topk, 1 << 30)
        perm = torch.randperm(M, generator=g).to(DEV)
        shuffled = ki.indexer_topk(q[perm], k, w[perm], ks[perm], ke[perm], topk, 1 << 30)
        assert torch.equal(shuffled, base[perm])
        sub = perm[:3]
        alone = ki.indexer_topk(q[sub], k, w[sub], ks[sub], ke[sub], topk, 4 * N * 2)
        assert torch.equal(alone, base[sub])


def test_providers_through_the_ops():
    """The custom ops dispatch to the Triton providers when registered (and back when not)."""
    from provider_state import registry_restored

    from cpgraph.ops.providers import active_provider, register_provider, unregister_provider

    table = ki.providers()
    with registry_restored(DEV), select_tuning(**SHORT_SAMPLE):
        _dispatch_through_the_ops(table, active_provider, register_provider, unregister_provider)


def _dispatch_through_the_ops(table, active_provider, register_provider, unregister_provider):
    for op, fn in table.items():
        register_provider(op, DEV, "triton", fn)
    try:
        assert all(active_provider(op, DEV) == "triton" for op in table)
        q, k, w = integer_inputs(3, 6, 2, 16, 30)
        ks, ke = windows(_gen(4), 6, 30)
        got = ops.indexer_topk(q, k, w, ks, ke, 5, 4 * 30 * 2)
        assert torch.equal(got, ix.indexer_topk_reference(q, k, w, ks, ke, 5, 1 << 30))
        logits = ops.indexer_logits(q, k, w, ks, ke)
        assert torch.equal(ops.topk_ragged(logits, ks, ke, 5), got)
    finally:
        for op in table:
            unregister_provider(op, DEV)


# ------------------------------------------------------- production (GPU)
def _assert_topk_agrees(got, want, scores, got_scores, ks, ke, topk):
    """Same ids as the reference unless scores tie within the two sides' rounding; checked on the scores.

    A key can only change sides when its score and the k-th score move past
    each other by rounding, so every key in one set but not the other must
    lie within twice the row's largest score difference (ours vs the
    reference's) of the reference's k-th score.
    """
    diff_rows = (got != want).any(dim=1).nonzero().flatten().tolist()  # sync-ok (test)
    for s in diff_rows:
        a = {int(t) for t in got[s].tolist() if t >= 0}
        b = {int(t) for t in want[s].tolist() if t >= 0}
        row = scores[s]
        fin = torch.isfinite(row)
        err = float((got_scores[s][fin] - row[fin]).abs().max())
        picked = want[s][want[s] >= 0].long()
        kth = float(row[picked].min())  # the reference's k-th score (ids are in position order)
        for t in a ^ b:
            assert abs(float(row[t]) - kth) <= 2 * err, f"row {s}: key {t} score {float(row[t])} vs k-th {kth}"
    return len(diff_rows)


def _prod_batch(lens, prefix, H=64, D=128, seed=0):
    """Causal windows of several requests over one ragged full view (cached prefix included)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    starts, ks, ke = 0, [], []
    for n, p in zip(lens, prefix):
        pos = torch.arange(p, p + n, device="cuda")
        ks.append(torch.full((n,), starts, device="cuda"))
        ke.append(starts + pos + 1)
        starts += p + n
    ks, ke = torch.cat(ks), torch.cat(ke)
    M, N = ks.shape[0], starts
    q = torch.randn(M, H, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(N, D, device="cuda", generator=g).bfloat16()
    w = torch.randn(M, H, device="cuda", generator=g) * (H**-0.5 * D**-0.5)
    return q, k, w, ks, ke


gpu = pytest.mark.skipif(DEV != "cuda", reason="production shapes need a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("lens,prefix", [([4096], [0]), ([1500, 700, 1900], [0, 512, 0]), ([32] * 8, [2560] * 8)])
def test_gpu_production_indexer_topk(lens, prefix):
    topk = 2048
    q, k, w, ks, ke = _prod_batch(lens, prefix)
    budget = 64 << 20
    got = ki.indexer_topk(q, k, w, ks, ke, topk, budget)
    want = ix.indexer_topk_reference(q, k, w, ks, ke, topk, budget)
    scores = ix.indexer_logits_reference(q, k, w, ks, ke)
    got_scores = ki.indexer_logits(q, k, w, ks, ke)
    fin = torch.isfinite(scores)
    assert torch.equal(fin, torch.isfinite(got_scores))
    err = (got_scores[fin] - scores[fin]).abs().max()
    assert float(err) <= 1e-5 * float(scores[fin].abs().max()), f"scores differ by {float(err):.3e}"
    # Selection alone on the same fp32 scores is exact (the tie rule decides every tie) ...
    assert torch.equal(ki.topk_ragged(got_scores, ks, ke, topk), ix.topk_ragged_reference(got_scores, ks, ke, topk))
    # ... and the fused op differs from the reference only where rounding swaps near-equal scores.
    differing = _assert_topk_agrees(got, want, scores, got_scores, ks, ke, topk)
    print(f"rows {q.shape[0]}: {differing} differ from the reference, all within rounding; max score error {float(err):.2e}")
    slots = torch.randperm(k.shape[0] + 64, device="cuda")[: k.shape[0]]
    assert torch.equal(ki.topk_paged(got_scores, ks, ke, topk, slots),
                       ix.topk_paged_reference(got_scores, ks, ke, topk, slots))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("sample,cols", [(1024, None), (64, None), (1024, 16)])
def test_gpu_zero_heavy_ties_exact(sample, cols):
    """ReLU zeros everywhere (most dots negative) at production shape: ids equal the reference's exactly."""
    q, k, w, ks, ke = _prod_batch([3000], [0], seed=1)
    q = (q.float() - 2.0).bfloat16()  # most head dots negative -> many exact-zero scores
    k = k.abs()
    got_scores = ki.indexer_logits(q, k, w, ks, ke)
    assert int((got_scores == 0).sum()) > 1_000_000  # sync-ok (test)
    saved = ki.tuning()
    try:
        ki.set_tuning(SELECT_SAMPLE=sample)
        got = ki.indexer_topk(q, k, w, ks, ke, 2048, 64 << 20)
        want = ix.topk_ragged_reference(got_scores, ks, ke, 2048)
        assert torch.equal(got, want)
        # Random scores (few ties) through the same selection, with the given candidate scratch.
        logits = torch.randn(q.shape[0], k.shape[0], device="cuda")
        M = q.shape[0]
        out = torch.empty((M, 2048), dtype=torch.int32, device="cuda")
        scratch = None if cols is None else torch.empty((M, cols), dtype=torch.int32, device="cuda")
        ki.select_rows(logits, ks, ke, out, 0, M, 2048, scratch=scratch)
        assert torch.equal(out, ix.topk_ragged_reference(logits, ks, ke, 2048))
    finally:
        ki.set_tuning(**saved)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block,warps,compact,prefetch,float_pass,list_step",
                         [(512, 4, False, False, False, False), (512, 4, True, False, False, False),
                          (512, 4, True, True, False, False), (256, 2, False, True, False, False),
                          (128, 1, False, False, False, False), (256, 1, True, True, False, False),
                          (128, 2, True, False, False, False), (128, 1, True, True, False, False),
                          (128, 1, True, False, True, False), (128, 2, False, False, True, False),
                          (512, 4, True, False, True, False), (128, 1, True, True, False, True),
                          (128, 1, True, False, True, True), (128, 1, False, True, False, True),
                          (256, 2, True, False, True, True), (512, 4, True, True, False, True)])
def test_gpu_select_launch_forms_exact(block, warps, compact, prefetch, float_pass, list_step):
    """Every launch form the selection's sweep times gives the reference's ids (production-length causal rows)."""
    g = torch.Generator(device="cuda").manual_seed(block + warps)
    M = N = 6000
    logits = torch.randn(M, N, device="cuda", generator=g)
    logits[::7] = logits[::7].round(decimals=1)  # tie-heavy rows
    ks = torch.zeros(M, dtype=torch.int64, device="cuda")
    ke = torch.arange(1, M + 1, device="cuda")
    out = torch.empty((M, 2048), dtype=torch.int32, device="cuda")
    ki.select_rows(logits, ks, ke, out, 0, M, 2048, block=block, num_warps=warps, compact=compact, prefetch=prefetch,
                   float_pass=float_pass, list_step=list_step)
    rows = torch.cat([torch.arange(2000, 2200), torch.arange(M - 300, M)]).cuda()
    assert torch.equal(out[rows], ix.topk_ragged_reference(logits[rows], ks[rows], ke[rows], 2048))


@pytest.mark.gpu
@gpu
def test_gpu_row_local_and_cuda_graph():
    q, k, w, ks, ke = _prod_batch([2048, 1024], [0, 1024], seed=2)
    topk = 2048
    base = ki.indexer_topk(q, k, w, ks, ke, topk, 64 << 20)
    perm = torch.randperm(q.shape[0], device="cuda")
    assert torch.equal(ki.indexer_topk(q[perm], k, w[perm], ks[perm], ke[perm], topk, 32 << 20), base[perm])
    sub = perm[:777]
    assert torch.equal(ki.indexer_topk(q[sub], k, w[sub], ks[sub], ke[sub], topk, 64 << 20), base[sub])
    # Captured and replayed (no host sync, static shapes).
    out = ki.indexer_topk(q, k, w, ks, ke, topk, 16 << 20)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ki.indexer_topk(q, k, w, ks, ke, topk, 16 << 20)
    out.fill_(-5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, base)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("keys_m,group", [(False, 32), (True, 0), (True, 32)])
def test_gpu_fp8_scoring_production(keys_m, group):
    saved = ki.tuning()
    try:
        ki.set_tuning(FP8_KEYS_M=keys_m, FP8_ACC_GROUP=group)
        _fp8_production()
    finally:
        ki.set_tuning(**saved)


def _fp8_production():
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, w, ks, ke = _prod_batch([2048], [0], seed=3)
    qh, kh = ops.hadamard(q), ops.hadamard(k)
    q_bytes, w_q = ops.indexer_q_quant(qh, w)
    k_scale = ix.ue8m0_scale(kh.float().abs().amax(-1))
    k_bytes = ix.e4m3_bytes(kh, k_scale)
    want = ix.indexer_logits_fp8_reference(q_bytes, k_bytes, k_scale, w_q, ks, ke)
    got = ki.indexer_logits_fp8(q_bytes, k_bytes, k_scale, w_q, ks, ke)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    err = float((got[fin] - want[fin]).abs().max())
    print(f"fp8 tuning {ki.tuning()['FP8_KEYS_M']}/{ki.tuning()['FP8_ACC_GROUP']}: max abs error {err:.3e} "
          f"of max |score| {float(want[fin].abs().max()):.3e}")
    torch.testing.assert_close(got[fin], want[fin], rtol=FP8_TOL, atol=FP8_TOL * float(want[fin].abs().max()))
    del g
    # The fused FP8 form: chunked scoring + selection, ids as the reference's up to rounding ties.
    topk = 1024
    ids = ki.indexer_topk(q_bytes, k_bytes, w_q, ks, ke, topk, 4 << 20, k_scale)
    ref_ids = ix.topk_ragged_reference(want, ks, ke, topk)
    assert torch.equal(ki.topk_ragged(got, ks, ke, topk), ids)  # same scores chunked or not: same ids
    _assert_topk_agrees(ids, ref_ids, want, got, ks, ke, topk)


def test_tuning_overrides_are_validated(tmp_path, monkeypatch):
    saved = ki.tuning()
    try:
        ki.set_tuning(SELECT_BLOCK=1024, KEYS_M=True)
        assert ki.tuning()["SELECT_BLOCK"] == 1024 and ki.tuning()["KEYS_M"] is True
        with pytest.raises(ValueError, match="unknown tuning parameter 'BLOK'"):
            ki.set_tuning(BLOK=3)
        with pytest.raises(ValueError, match="'KEYS_M' must be bool"):
            ki.set_tuning(KEYS_M=1)
        with pytest.raises(ValueError, match="SELECT_SAMPLE must be a power of two"):
            ki.set_tuning(SELECT_SAMPLE=1000)
        with pytest.raises(ValueError, match="SELECT_BLOCK must be a power of two"):
            ki.set_tuning(SELECT_BLOCK=1 << 16)
        with pytest.raises(ValueError, match="FP8_ACC_GROUP must be"):
            ki.set_tuning(FP8_ACC_GROUP=16)
        with pytest.raises(ValueError, match="'SELECT_LIST_STEP' must be bool"):
            ki.set_tuning(SELECT_LIST_STEP=1)
        with pytest.raises(ValueError, match="SELECT_LIST_STEP needs SELECT_WARPS < 8"):
            ki.set_tuning(SELECT_LIST_STEP=True, SELECT_WARPS=8)
        assert ki.tuning()["SELECT_LIST_STEP"] == saved["SELECT_LIST_STEP"]
        path = tmp_path / "tune.json"
        path.write_text('{"KEY_TILE": 64, "SELECT_SAMPLE": 32}')  # a short sample: the interpreter sorts it per row
        monkeypatch.setenv("CPGRAPH_INDEXER_TUNING", str(path))
        ki._tuning_from_env()
        assert ki.tuning()["KEY_TILE"] == 64 and ki.tuning()["SELECT_SAMPLE"] == 32
        # Results do not depend on the tuning.
        q, k, w = integer_inputs(9, 5, 2, 16, 40)
        ks, ke = windows(_gen(10), 5, 40)
        assert torch.equal(ki.indexer_topk(q, k, w, ks, ke, 6, 1 << 20), ix.indexer_topk_reference(q, k, w, ks, ke, 6, 1 << 20))
    finally:
        ki.set_tuning(**saved)


def test_memory_plan_counts_the_select_scratch():
    """plan/memory.py restates the select kernel's scratch width (the plan imports no kernels): they must agree."""
    from cpgraph.kernels.topk_select import scratch_columns
    from cpgraph.plan import memory

    for n, k in [(1, 1), (37, 16), (4096, 2048), (32768, 2048), (131072, 2048), (100, 2048)]:
        assert memory._select_scratch_columns(n, k) == scratch_columns(n, k)
