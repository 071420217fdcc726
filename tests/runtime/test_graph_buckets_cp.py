"""CUDA-graph buckets under CP: every step a scheduler can form lands in a bucket the warm-up prepares.

No model here: random steps (extends of 1..budget tokens over cached prefixes whose pages are owned
by any rank, as a radix cache under CP leaves them), planned as the prefill engine plans a CP step
over a ``graphed_forward`` (``plan_in_buckets``), with real ``build_batch`` metadata on every rank.
The check does not use the bound it tests: it reads each rank's actual ``M``, ``P`` and ``N`` and
asks the runner for the bucket, which must be one of ``reachable_buckets`` -- the list the serve
warm-up prepares on every rank.  Adversarial steps are drawn on purpose: many one-token requests (all
rows on one rank) and prefixes owned by one rank only.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from cpgraph.models import build_batch
from cpgraph.plan import plan_prefill
from cpgraph.runtime.graph_runner import GraphRunner, graphed_forward, kv_rows_bound, plan_in_buckets

PAGE, BUDGET, CAP, MAX_REQ = 16, 96, 128, 6


def _step(rnd: random.Random, cp: int):
    """``(prefix_lens, extend_lens, prefix page owners)``: at most MAX_REQ requests, BUDGET tokens, CAP prefix rows."""
    b = rnd.randint(1, MAX_REQ)
    kind = rnd.choice(("random", "tiny", "one_owner"))
    extend, left = [], BUDGET
    for i in range(b):
        if left <= 0:
            break
        e = 1 if kind == "tiny" else rnd.randint(1, max(1, left // (b - i)))
        extend.append(e)
        left -= e
    prefix, owners, cap = [], [], CAP // PAGE
    for _ in extend:
        pages = rnd.randint(0, min(cap, 4))
        cap -= pages
        prefix.append(pages * PAGE)
        start = rnd.randrange(cp)
        owners.append([0 if kind == "one_owner" else (start + k) % cp for k in range(pages)])
    return prefix, extend, owners


def _rank_batches(plan, owners, cp):
    tokens = [list(range(1, n + 1)) for n in plan.extend_lens.tolist()]
    out = []
    for rank in range(cp):
        pages = itertools.count()  # this rank's physical pages, distinct across the step's requests
        tables = [[next(pages) if o == rank else -1 for o in owners[i] + list(plan.page_owners(i))]
                  for i in range(plan.num_requests)]
        out.append(build_batch(plan, tokens, tables, rank=rank, prefix_page_owners=owners))
    return out


@pytest.mark.parametrize("derive", [True, False], ids=["derived_kv", "own_kv"])
@pytest.mark.parametrize("cp", [2, 4])
def test_every_step_lands_in_a_reachable_bucket(cp, derive):
    runner = GraphRunner(lambda i, m: None, max_requests=MAX_REQ, cp_size=cp, capture=False,
                         page_size=PAGE if derive else None)
    reachable = set(runner.reachable_buckets(BUDGET, PAGE, CAP))
    assert all(b.cp_size == cp and b.requests == MAX_REQ for b in reachable)
    rnd = random.Random(cp * 10 + derive)
    seen = set()
    for _ in range(150):
        prefix, extend, owners = _step(rnd, cp)
        plan = plan_in_buckets(runner.row_buckets, prefix, extend, cp_size=cp, page_size=PAGE)
        assert plan.num_rows in runner.row_buckets
        buckets = {runner.bucket_for(ids, meta) for ids, meta in _rank_batches(plan, owners, cp)}
        assert len(buckets) == 1, f"ranks picked different buckets: {buckets}"  # no talking needed
        (bucket,) = buckets
        assert bucket in reachable, (prefix, extend, owners, bucket)
        seen.add(bucket)
    assert len(seen) >= 8  # the draw covered many buckets, not one


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_kv_rows_bound_holds_on_real_batches(cp):
    """The derived KV-view bucket must hold the real view: ``N <= kv_rows_bound(M, P)`` on every rank."""
    rnd = random.Random(cp)
    tight = 0
    for _ in range(200):
        prefix, extend, owners = _step(rnd, cp)
        plan = plan_prefill(prefix, extend, cp_size=cp, page_size=PAGE)
        for ids, meta in _rank_batches(plan, owners, cp):
            m, p, n = ids.shape[0], meta.prefix_slots.shape[0], meta.kv_source.shape[0]
            bound = kv_rows_bound(m, p, MAX_REQ, PAGE, cp)
            assert n <= bound, (prefix, extend, owners, m, p, n, bound)
            tight += n > bound // 2
    assert tight > 0  # the bound is not vacuous: real views come within a factor 2 of it


def test_plan_in_buckets_pads_rows_to_a_bucket_and_keeps_a_bucket_plan():
    ladder = (16, 24, 32, 48)
    plain = plan_prefill([0, 32], [20, 9], cp_size=2, page_size=PAGE)
    planned = plan_in_buckets(ladder, [0, 32], [20, 9], cp_size=2, page_size=PAGE)
    assert plain.num_rows not in ladder and planned.num_rows == min(v for v in ladder if v >= plain.num_rows)
    assert planned.static_padding == planned.num_rows - plain.num_rows and planned.compute_rows == plain.compute_rows
    exact = plan_in_buckets(ladder, [0], [64], cp_size=2, page_size=PAGE)  # 64 tokens / 2 ranks: M = 32
    assert exact.num_rows == 32 and exact.static_padding == 0
    with pytest.raises(ValueError, match="exceeds the largest bucket 48"):
        plan_in_buckets(ladder, [0], [200], cp_size=1, page_size=PAGE)


def test_graphed_forward_under_cp_plans_in_its_buckets_and_refuses_other_rows():
    calls = []

    def model_forward(ids, meta, mla, index):
        calls.append(ids.shape[0])
        from cpgraph.models.model import ForwardOutput

        return ForwardOutput(torch.zeros(meta.last_token_index.shape[0], 8), None, None)

    fwd = graphed_forward(model_forward, max_requests=4, cp_size=2, capture=False, page_size=PAGE)
    assert fwd.cp_size == 2
    plan = fwd.plan([0, 0], [20, 9], PAGE)
    assert plan.num_rows in (16, 24, 32)
    pools = ([torch.zeros(4)], [torch.zeros(4)])
    (ids, meta), _ = _rank_batches(plan, [[], []], 2)
    out = fwd(ids, meta, *pools)
    assert out.logits.shape == (2, 8) and set(calls) == {plan.num_rows}  # prepared, then run (no capture on CPU)
    raw = plan_prefill([0, 0], [20, 9], cp_size=2, page_size=PAGE)
    (ids, meta), _ = _rank_batches(raw, [[], []], 2)
    with pytest.raises(ValueError, match="not a row bucket; plan it with GraphRunner.plan"):
        fwd(ids, meta, *pools)
