"""The MTP draft under CP equals the single-device draft: gloo, 2 and 4 ranks, one compile per rank.

Each rank compiles only the draft graph (``DraftModel``, aot_eager, CP
passes) and feeds it the target's hidden rows *it* computes (CP-local: the
plan's row layout of this rank), taken from one single-device target run, so
the test isolates the draft: its owner-sharded KV (layer ``num_hidden_layers``),
its materialisation across ranks and its last-token gather.  The reference
is the same driver on one device with the eager draft.  Batches: several
requests, cached-prefix hits (the prefix pass runs the draft too), extends of
one or two tokens, prompts longer than ``index_topk`` (the draft's own
indexer selects).  Checked: draft logits identical on every rank and equal to
the single-device ones, and every draft KV page (MLA records and index-K)
byte-identical to the single-device page of the same logical position.

A rank's GEMMs have fewer rows than the single-device run's; every job runs
with fixed-order matrix products (``tests/row_invariant.py``), so a row's
bits depend only on that row's inputs and the comparisons are bit-exact by
construction at any thread count (docs/bitwise.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "models"))
from cp_model import CP_TIMEOUT_S  # noqa: E402
from mtp_reference import PAGE  # noqa: E402
from dist_utils import shared_pool  # noqa: E402
from row_invariant import row_invariant_matmul  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.bitexact]

# (prompt lengths, cached prefix lengths).  One batch; its prefix pass and its extend pass share a
# graph (build_batch never gives prefix_slots 0 or 1 rows).
# 1- and 2-token extends, prefix hits, page-tail slack, prompts longer than index_topk (48): the
# draft's own indexer selects.
BATCH = ([40, 17, 33, 2, 70, 29], [16, 0, 32, 0, 64, 16])
E2E_BATCH = (BATCH[0], [0] * len(BATCH[0]))
SAMPLED = [3, 1, 4, 1, 5, 9]

_BUILT: dict = {}


def _prompts(lens, seed):
    import mtp_reference as ref

    g = torch.Generator().manual_seed(100 + seed)
    return [torch.randint(0, ref.CONFIG["vocab_size"], (n,), generator=g).tolist() for n in lens]


def _model():
    if "model" not in _BUILT:
        import mtp_reference as ref

        from cpgraph.models.prefill import make_layout

        model = ref.build()
        model.kv_layout = make_layout(model, "bf16", ref.PAGE)
        _BUILT["model"] = model
    return _BUILT["model"]


def _target_hidden(model, prompts):
    """``hidden[i][pos]``: the single-device target's final-normed hidden state (one pass per batch)."""
    from test_mtp import _target_hidden as single_device_hidden

    return single_device_hidden(model, prompts)


def _local_rows(plan, rank, hidden):
    """The rows this rank computes in ``plan``: ``hidden[req][pos]``, zeros for dummy rows."""
    rp = plan.rank(rank, rerange=True)
    req, pos = rp.req_index.tolist(), rp.positions.tolist()
    width = hidden[0].shape[1]
    return torch.stack([hidden[i][p] if i >= 0 else torch.zeros(width) for i, p in zip(req, pos)])


@torch.no_grad()
def run_draft(draft, model, prompts, prefix, hidden, *, rank=0, cp=1, seed=None):
    """The draft over a prefix pass and an extend pass, as ``run_prefill`` drives them (draft layer only).

    ``seed``: single-device draft pages ``{(request, logical page): (mla bytes, index-K bytes)}``; the
    prefix pass is then replaced by writing the cached prefix's pages to their owners.  Returns
    ``(draft logits [B, vocab], pages)`` with the pages this rank owns.
    """
    import mtp_reference as ref

    from cpgraph.models.batch import build_batch, build_draft_inputs
    from cpgraph.plan import plan_prefill
    from cpgraph.runtime.engine import draft_pools, pool_config
    from cpgraph.runtime.kv_pool import KVPool

    ps, B = ref.PAGE, len(prompts)
    with_prefix = [i for i in range(B) if prefix[i]]
    pre = plan_prefill([0] * len(with_prefix), [prefix[i] for i in with_prefix], cp_size=cp, page_size=ps)
    ext = plan_prefill(prefix, [len(p) - q for p, q in zip(prompts, prefix)], cp_size=cp, page_size=ps)
    prefix_owners = [[] for _ in range(B)]
    for j, i in enumerate(with_prefix):
        prefix_owners[i] = pre.page_owners(j)
    owners = [prefix_owners[i] + ext.page_owners(i) for i in range(B)]
    pool = KVPool(pool_config(model, "bf16", ps, sum(o.count(rank) for o in owners), rank, draft=True))
    tables = [pool.alloc_pages_with_owners(o) for o in owners]
    mla, index = draft_pools(pool, model)

    def one_pass(plan, reqs, toks, tabs, powners, sampled):
        ids, meta = build_batch(plan, toks, tabs, rank=rank, prefix_page_owners=powners)
        dinputs = build_draft_inputs(plan, [prompts[i] for i in reqs], sampled, rank=rank)
        return draft(_local_rows(plan, rank, [hidden[i] for i in reqs]), dinputs, meta, mla, index)

    if with_prefix and seed is None:
        one_pass(pre, with_prefix, [prompts[i][: prefix[i]] for i in with_prefix],
                 [tables[i][: len(prefix_owners[i])] for i in with_prefix], [[] for _ in with_prefix], None)
    elif with_prefix:
        for i in with_prefix:
            for j, page in enumerate(tables[i][: len(prefix_owners[i])]):
                if page >= 0:
                    rows = slice(page * ps, (page + 1) * ps)
                    for dst, raw in zip((mla, index), seed[(i, j)]):
                        dst[rows] = torch.from_numpy(np.frombuffer(raw, dtype=np.float32).reshape(ps, -1).copy())
    out = one_pass(ext, range(B), [p[q:] for p, q in zip(prompts, prefix)], tables, prefix_owners,
                   torch.tensor(SAMPLED[:B]))
    pages = {}
    for i in range(B):
        for j, page in enumerate(tables[i]):
            if page >= 0:
                rows = slice(page * ps, (page + 1) * ps)
                pages[(i, j)] = (mla[rows].numpy().tobytes(), index[rows].numpy().tobytes())
    return out.logits.numpy().copy(), pages


def _all_pages(res, model):
    """``{(request, logical page, payload): bytes}`` of every page a ``run_prefill`` result's pool holds."""
    import mtp_reference as ref

    ps, pool = ref.PAGE, res.pool
    out = {}
    for i, table in enumerate(res.tables):
        for j, page in enumerate(table):
            if page < 0:
                continue
            rows = slice(page * ps, (page + 1) * ps)
            for layer in range(pool.config.num_layers):
                out[(i, j, "mla", layer)] = pool.mla_pool(layer)[rows].numpy().tobytes()
            for layer in pool.config.active_index_layers:
                out[(i, j, "index", layer)] = pool.index_pool(layer)[rows].numpy().tobytes()
    return out


def _compiled(ctx, what):
    key = (what, ctx.group_name, ctx.world_size)
    if key not in _BUILT:
        from cp_model import use_numerics_compile_settings

        from cpgraph.passes import CPConfig, compile

        use_numerics_compile_settings()
        module = _model().draft_module() if what == "draft" else _model()
        _BUILT[key] = compile(module, CPConfig(group=ctx.group_name, cp_size=ctx.world_size), backend="aot_eager",
                              dynamic=True)
    return _BUILT[key]


def job_end_to_end(ctx, lens, prefix):
    """This rank's ``run_prefill`` with the compiled target and draft (``draft_tokens`` fixed)."""
    with row_invariant_matmul():
        return _end_to_end(ctx, lens, prefix)


def _end_to_end(ctx, lens, prefix):
    from cpgraph.runtime.engine import run_prefill

    model = _model()
    target = _compiled(ctx, "target")
    res = run_prefill(lambda *a, **k: target(*a, **k), model, _prompts(lens, 0), prefix_lens=prefix,
                      page_size=PAGE, rank=ctx.rank, cp_size=ctx.world_size, draft=_compiled(ctx, "draft"),
                      draft_tokens=SAMPLED)
    return res.draft_logits.numpy().copy(), res.logits.numpy().copy(), _all_pages(res, model)


def job_draft_only(ctx, lens, prefix, seed):
    with row_invariant_matmul():
        model = _model()
        prompts = _prompts(lens, 0)
        return run_draft(_compiled(ctx, "draft"), model, prompts, prefix, _target_hidden(model, prompts),
                         rank=ctx.rank, cp=ctx.world_size, seed=seed)


def job_reference(ctx, lens, prefix):
    """One device, eager: ``run_prefill`` with the draft (``E2E_BATCH``), and the draft-only driver."""
    with row_invariant_matmul():
        return _reference_runs(lens, prefix)


def _reference_runs(lens, prefix):
    from cpgraph.runtime.engine import run_prefill

    model = _model()
    prompts = _prompts(lens, 0)
    res = run_prefill(lambda *a, **k: model(*a, **k), model, prompts, prefix_lens=E2E_BATCH[1], page_size=PAGE,
                      draft=model.draft_module(), draft_tokens=SAMPLED)
    draft_only = run_draft(model.draft_module(), model, prompts, prefix, _target_hidden(model, prompts))
    return {"e2e": (res.draft_logits.numpy().copy(), res.logits.numpy().copy(), _all_pages(res, model)),
            "draft_only": draft_only}


_REFERENCE: dict = {}


def _reference():
    if not _REFERENCE:
        _REFERENCE.update(shared_pool(1, CP_TIMEOUT_S).run(job_reference, *BATCH)[0])
    return _REFERENCE


def _same(got, want, what):
    assert np.array_equal(got, want), f"{what}: max |diff| {np.abs(got - want).max():.3e}"


def test_target_and_draft_end_to_end_cp2():
    pending = None if _REFERENCE else shared_pool(1, CP_TIMEOUT_S).submit(job_reference, *BATCH)
    results = shared_pool(2, CP_TIMEOUT_S).run(job_end_to_end, *E2E_BATCH)
    if pending is not None:
        _REFERENCE.update(pending.result()[0])
    ref_draft, ref_logits, ref_pages = _reference()["e2e"]
    for r in results:
        assert np.array_equal(r[0], results[0][0]) and np.array_equal(r[1], results[0][1]), "ranks disagree"
    _same(results[0][0], ref_draft, "CP draft logits != single-device")
    _same(results[0][1], ref_logits, "CP target logits != single-device")
    owned = [set(r[2]) for r in results]
    assert sum(len(o) for o in owned) == len(ref_pages) and set().union(*owned) == set(ref_pages)
    N = _model().config.draft_layer
    assert any(key[3] == N for key in ref_pages)  # the draft's layer is in the pool and compared
    for rank, r in enumerate(results):
        for key, raw in r[2].items():  # the target's pages and the draft's: bit-identical
            assert raw == ref_pages[key], f"rank {rank}, page {key}: bytes differ from the single-device page"


def test_draft_cp4_equals_single_device():
    ref_logits, ref_pages = _reference()["draft_only"]
    results = shared_pool(4, CP_TIMEOUT_S).run(job_draft_only, *BATCH, ref_pages)
    for r in results:
        assert np.array_equal(r[0], results[0][0]), "ranks disagree"
    _same(results[0][0], ref_logits, "CP draft logits != single-device")
    # Owner-sharded: each logical page of the draft layer lives on exactly one rank, bytes as on one device.
    owned = [set(r[1]) for r in results]
    assert sum(len(o) for o in owned) == len(ref_pages) and set().union(*owned) == set(ref_pages)
    for rank, r in enumerate(results):
        for key, (mla, index) in r[1].items():
            assert mla == ref_pages[key][0], f"rank {rank}, page {key}: draft MLA records differ"
            assert index == ref_pages[key][1], f"rank {rank}, page {key}: draft index-K differs"


# ----------------------------------------------------------------------------- served by PrefillEngine
# The draft behind ``cpgraph serve --cp 2 --draft``: the leader chooses each first token (greedy, or drawn at a
# temperature without a seed), the followers must give their draft rows the same token (the admit op carries
# the rule and a seed the leader fixed), over chunks (budget 32) and in one batch.
SERVED_LENS = [40, 70, 17, 33]
SERVED_TEMPS = [0.0, 3.0, 3.0, 0.0]


def job_served_draft(ctx, lens, temps, graphs=False):
    with row_invariant_matmul():
        return _served_draft(ctx, lens, temps, graphs)


def _served_draft(ctx, lens, temps, graphs):
    from cpgraph.runtime.prefill_engine import PrefillEngine, engine_request
    from cpgraph.runtime.scheduler import SchedulerConfig

    model = _model()
    target, draft = _compiled(ctx, "target"), _compiled(ctx, "draft")

    def forward(*a, **k):
        return target(*a, **k)

    if graphs:  # as cpgraph serve --cp 2 --cuda-graphs --draft builds them (no capture on CPU: padded buckets)
        from cpgraph.runtime.draft_graphs import graphed_draft
        from cpgraph.runtime.graph_runner import graphed_forward

        forward = graphed_forward(forward, max_requests=4, cp_size=ctx.world_size, page_size=PAGE)
        draft = graphed_draft(draft, forward)
    steps, draft_logits = [], []

    def recorded(hidden, dinputs, meta, mla, index):
        out = draft(hidden, dinputs, meta, mla, index)
        draft_logits.append(out.logits.numpy().copy())
        return out

    recorded.draft = draft  # a wrapper names what it wraps (the engine checks a graphed target's draft is graphed)

    eng = PrefillEngine(forward, model, num_pages=64, page_size=PAGE, rank=ctx.rank, cp_size=ctx.world_size,
                        scheduler=SchedulerConfig(token_budget=32, max_batch_requests=4), draft=recorded)
    run = eng._run

    def logged(chunks):
        steps.append(list(chunks))
        return run(chunks)

    eng._run = logged
    answers = None
    if ctx.rank == 0:
        handles = [eng.submit(engine_request(p, temperature=t)) for p, t in zip(_prompts(lens, 1), temps)]
        eng.run_until_idle()
        eng.stop_followers()
        answers = [(h.id, h.result.status, h.result.token, h.result.draft_token, h.result.chunks) for h in handles]
    else:
        eng.follow()
    eng.close()
    final = {}  # request id -> the draft logits row of its last chunk (a later step overwrites an earlier one)
    for chunks, logits in zip(steps, draft_logits):
        for j, (rid, _, _) in enumerate(chunks):
            final[rid] = logits[j]
    return answers, final, eng.cache.tree.fingerprint()


def job_single_device_drafts(ctx, lens, tokens):
    """Per prompt alone, one device, eager: ``run_prefill``'s draft logits given the served first token."""
    from cpgraph.runtime.engine import run_prefill

    model = _model()
    with row_invariant_matmul():
        return [run_prefill(lambda *a, **k: model(*a, **k), model, [p], page_size=PAGE, draft=model.draft_module(),
                            draft_tokens=[t]).draft_logits[0].numpy().copy()
                for p, t in zip(_prompts(lens, 1), tokens)]


@pytest.mark.parametrize("graphs", [False, True], ids=["plain", "graph_buckets"])
def test_served_draft_cp2_reads_the_leaders_first_tokens(graphs):
    """``graph_buckets``: the target and the draft over CUDA-graph buckets (``graphed_forward`` planned in row
    buckets, ``graphed_draft`` on the bucket's padded buffers), as ``--cuda-graphs --draft`` builds them."""
    results = shared_pool(2, CP_TIMEOUT_S).run(job_served_draft, SERVED_LENS, SERVED_TEMPS, graphs)
    answers, leader, fingerprint = results[0]
    assert [a[1] for a in answers] == ["finished"] * len(SERVED_LENS)
    assert max(a[4] for a in answers) >= 2  # chunked
    assert results[1][2] == fingerprint  # the followers' trees went through the same ops
    want = shared_pool(1, CP_TIMEOUT_S).run(job_single_device_drafts, SERVED_LENS, [a[2] for a in answers])[0]
    for (rid, _, token, draft_token, _), ref in zip(answers, want):
        assert np.array_equal(results[1][1][rid], leader[rid]), "ranks disagree"
        _same(leader[rid], ref, f"request {rid}: served CP draft logits != single-device given token {token}")
        assert draft_token == int(ref.argmax())
