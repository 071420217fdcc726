"""CP prefill equals the single-device run: gloo, 2 and 4 spawned ranks, one compile per rank.

Each rank compiles the model once with the CP passes (``tests/cp_model.py``:
a two-layer GLM-5-style model with a dense+indexer layer and a MoE+IndexCache
layer) and runs every batch of the test through it (prefix pass + extend pass
per batch).  The references -- the single-device compiled model, the eager
model and transformers 5.24 on the same prompts -- do not depend on the CP
size, so they are computed once per backend, in a process of their own while
the CP ranks work.  Batches cover mixed lengths, tiny extends (1 token, fewer
pages than ranks), prefix-cache hits and page-tail slack; on 2 ranks also a
batch of one request (its own graphs: a batch dimension of 1 specializes).

A rank computes only its own rows, so its GEMMs have fewer rows than the
single-device run's, and a BLAS GEMM's bits depend on the row count and the
thread count.  The bit-exact ``aot_eager`` test therefore runs both sides
with fixed-order matrix products (``tests/row_invariant.py``): every row's
bits are then set by that row's inputs alone, and the comparison holds by
construction at any thread count (docs/bitwise.md).  The Inductor test keeps
the machine's GEMMs and compares to a tolerance.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from cp_model import CP_TIMEOUT_S, PAGE  # noqa: E402
from dist_utils import shared_pool  # noqa: E402
from row_invariant import products_computed, row_invariant_matmul  # noqa: E402

pytestmark = pytest.mark.slow

# (prompt lengths, cached prefix lengths); the prompts themselves are seeded.  Every batch has
# at least two requests in both passes, so one compile per pass kind (with and without a cached
# prefix) serves them all.
BATCHES = [
    ([96, 40, 17, 130], [64, 0, 0, 16]),  # mixed lengths, prefix hits, page-tail slack
    ([17, 1, 33, 2], [16, 0, 32, 0]),  # tiny extends: 1-2 tokens each, fewer pages than ranks
    ([5, 70, 16, 29, 8, 45], [0, 64, 0, 16, 0, 32]),  # six requests; 13-token extend over a 2-page prefix
]
# One request: a batch dimension of size 1 specializes, so both passes are graphs of their own
# (two more compiles per rank); run on 2 ranks only, where they cost least.
ONE_REQUEST = [([61], [48])]  # 13-token extend over a 3-page prefix
# Inductor compiles are the slowest here (C++ kernels): one small batch with prefix hits and page-tail
# slack, whose extend pass is the one graph Inductor compiles (see ``_extend_pass_by``).
INDUCTOR_BATCHES = [([40, 17, 33], [16, 0, 16])]
# Every batch a backend's tests run, in order (a batch's prompts are seeded by its index here).
REFERENCE_BATCHES = {"aot_eager": BATCHES + ONE_REQUEST, "inductor": INDUCTOR_BATCHES}


def _prompts(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]


def _extend_pass_by(extend_fn, prefix_fn):
    """A forward for one ``run_prefill`` of a batch with a cached prefix: the extend pass runs ``extend_fn``.

    ``run_prefill`` calls its forward twice for such a batch: the prefix pass
    (no cached prefix: it writes the prefix's KV) and then the extend pass,
    which reads that KV and holds every op the prefix pass has plus the
    cached-prefix reads.  Under Inductor only the extend pass is compiled; the
    prefix pass runs through ``prefix_fn`` (the ``aot_eager`` build, already
    compiled for the bit-exact tests) -- the same on the CP ranks and in the
    single-device reference, so both extend passes read the same cache.
    """
    passes = iter([prefix_fn, extend_fn])

    def forward(ids, meta, mla, index, **kw):
        fn = next(passes, None)
        assert fn is not None, "run_prefill called its forward more than twice"
        return fn(ids, meta, mla, index, **kw)

    return forward


def _products(backend):
    """``aot_eager`` runs take fixed-order matrix products (bit-exact by construction); Inductor the machine's."""
    return row_invariant_matmul() if backend == "aot_eager" else contextlib.nullcontext()


def job_cp(ctx, backend, batches):
    """This rank's CP run of every batch, plus what each rank holds."""
    with _products(backend):
        return _cp_runs(ctx, backend, batches)


def _cp_runs(ctx, backend, batches):
    from cp_model import compiled_cp, model_pair

    from cpgraph.runtime.engine import run_prefill

    _, model = model_pair()
    before = products_computed()
    out = []
    for k, (lens, prefix) in enumerate(batches):
        forward = compiled_cp(ctx, backend)
        if backend == "inductor":
            assert any(prefix), "an Inductor batch needs a cached prefix (see _extend_pass_by)"
            forward = _extend_pass_by(forward, compiled_cp(ctx, "aot_eager"))
        res = run_prefill(forward, model, _prompts(lens, k), prefix_lens=prefix, page_size=PAGE, rank=ctx.rank,
                          cp_size=ctx.world_size)
        out.append({
            "cp": res.logits.numpy().copy(),
            "kv_bytes": res.kv_bytes,
            "pool_bytes": res.pool_bytes,
            "pages": res.pages_owned,
            "total_pages": res.total_pages,
            "bytes_per_page": res.bytes_per_page,
            "fixed_order_products": products_computed() - before,
        })
        before = products_computed()
    return out


def job_references(ctx, backend, batches):
    """The single-device compiled model, the eager model and transformers on every batch (one process)."""
    with _products(backend):
        return _reference_runs(backend, batches)


def _reference_runs(backend, batches):
    from cp_model import compiled, eager_forward, model_pair

    from cpgraph.runtime.engine import run_prefill

    hf, model = model_pair()
    out = []
    for k, (lens, prefix) in enumerate(batches):
        prompts = _prompts(lens, k)
        with torch.no_grad():
            hf_logits = np.stack([hf(torch.tensor([p])).logits[0, -1].float().numpy() for p in prompts])
        forward = compiled(backend)
        if backend == "inductor":
            forward = _extend_pass_by(forward, compiled("aot_eager"))
        single = run_prefill(forward, model, prompts, prefix_lens=prefix, page_size=PAGE)
        eager = run_prefill(eager_forward(), model, prompts, prefix_lens=prefix, page_size=PAGE)
        out.append({"single": single.logits.numpy(), "eager": eager.logits.numpy(), "hf": hf_logits})
    return out


_REFERENCES: dict = {}


def _run_with_references(world, backend, batches):
    """``(per-rank CP results, per-batch references)`` for ``batches``, which open ``REFERENCE_BATCHES[backend]``.

    The references do not depend on the CP size, so they are computed once per
    backend, for all of its batches, in a process of their own while the CP
    ranks work.
    """
    every = REFERENCE_BATCHES[backend]
    assert every[: len(batches)] == batches
    pending = None
    if backend not in _REFERENCES:
        pending = shared_pool(1, CP_TIMEOUT_S).submit(job_references, backend, every)
    results = shared_pool(world, CP_TIMEOUT_S).run(job_cp, backend, batches)
    if pending is not None:
        _REFERENCES[backend] = pending.result()[0]
    return results, _REFERENCES[backend][: len(batches)]


def _rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.bitexact
@pytest.mark.parametrize("world", [2, 4])
def test_cp_equals_single_device(world):
    results, refs = _run_with_references(world, "aot_eager", BATCHES + ONE_REQUEST if world == 2 else BATCHES)
    report = []
    for k, ref in enumerate(refs):
        per_rank = [r[k] for r in results]
        first = per_rank[0]
        for r in per_rank[1:]:
            assert np.array_equal(r["cp"], first["cp"]), f"batch {k}: ranks disagree"
        assert all(r["fixed_order_products"] > 0 for r in per_rank)  # the CP forward ran fixed-order products
        # Same row-local ops on the same rows (aot_eager runs the graph's aten ops eagerly; fixed-order
        # products): bit-identical whatever each side's row count and thread count.
        assert np.array_equal(first["cp"], ref["single"]), f"batch {k}: CP != single-device compiled"
        assert np.array_equal(ref["single"], ref["eager"]), f"batch {k}: compiled != eager"
        assert _rel(first["cp"], ref["hf"]) <= 1e-4, f"batch {k}: CP vs transformers"
        # Owner-sharded KV: each rank's pool holds exactly its pages; the pages partition the batch.
        assert sum(r["pages"] for r in per_rank) == first["total_pages"]
        for r in per_rank:
            assert r["pool_bytes"] == r["kv_bytes"] == r["pages"] * r["bytes_per_page"]
        report.append([r["kv_bytes"] / (first["total_pages"] * first["bytes_per_page"]) for r in per_rank])
    print(f"\nKV bytes per rank / replicated cache, cp={world}: {report}")


def test_cp_inductor_matches_within_tolerance():
    """Inductor reorders fp32 reductions, so compiled CP vs compiled one-device agree to a tolerance.

    Inductor compiles the extend pass over a cached prefix (``_extend_pass_by``):
    the graph with every CP op, prefix reads included.
    """
    results, refs = _run_with_references(2, "inductor", INDUCTOR_BATCHES)
    for k, ref in enumerate(refs):
        first = results[0][k]
        assert np.array_equal(results[1][k]["cp"], first["cp"])
        assert _rel(first["cp"], ref["single"]) <= 1e-5, f"batch {k}: CP vs single-device compiled"
        assert _rel(first["cp"], ref["eager"]) <= 1e-4
        assert _rel(first["cp"], ref["hf"]) <= 1e-4
