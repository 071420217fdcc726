"""GraphRunner under CP pads a cached prefix without moving any rank's rows: padded == unpadded at cp = 2 and 4.

Each rank runs one batch with cached prefixes (multi-page, owned by several
ranks) twice through ``run_prefill`` with the CP-compiled model
(``tests/cp_model.py``, aot_eager, compiled once per rank and shared with
``test_cp_numerics``: this module sorts before ``test_cache_cp``, which
closes those ranks): once as planned, once with the extend pass (the one that
reads the cached prefix) through a :class:`GraphRunner` whose KV buckets pad
every rank's prefix rows ``P`` and the view rows ``N`` (and the requests
``B``).  Capture is off on CPU; the padding is the same code a captured run
uses (the GPU form is ``test_cuda_capture_pads_a_cached_prefix_under_cp``).

Why a tolerance and not bitwise: padding changes the shapes the forward
runs -- ``N`` is the key count of the indexer's score GEMM, whose fp32 bits
on the CPU depend on the GEMM's shape and the thread count -- so equal bits
would be one BLAS's luck, not a property of the padding.  The valid logits
rows are compared with ``atol = 1e-5`` (the logits are O(1)); the bug this
guards against (rank ``r``'s current rows read ``r * (P' - P)`` rows off,
zero padding included) moved them by 3.3 on 2 ranks.

Threads: Dynamo guards on the thread count, so every other count recompiles
both graphs on every rank (about a minute each on 2 cores).  CI runs the
ranks' one thread, reusing ``test_cp_numerics``' compile;
``CPGRAPH_TEST_THREADS=1,2,4`` runs the sweep (on 2 cores: |padded - plain|
was 0.0 at 1, 2 and 4 threads, cp = 2 and 4).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cp_model import CP_TIMEOUT_S, PAGE  # noqa: E402
from dist_utils import shared_pool  # noqa: E402

PROMPT_LENS = [96, 40, 17, 130]
PREFIX_LENS = [64, 0, 0, 16]  # prefix pages owned by several ranks (round-robin of the prefix pass's plan)
THREADS = tuple(int(n) for n in os.environ.get("CPGRAPH_TEST_THREADS", "1").split(","))
ATOL = 1e-5


def _prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def through_runner(forward, cp_size: int, record: dict, capture: bool = False):
    """``run_prefill``'s forward: the prefix pass as is, the extend pass through a padding GraphRunner.

    The runner's buckets are chosen from the batch so that every padded
    length really grows: ``P`` by 24 rows (a page and a half: the padding need
    not be page aligned), ``N`` by 40, ``B`` by 2.  ``M`` is the plan's own
    (under CP the planner pads rows, the runner never does).
    """
    from cpgraph.models.model import ForwardOutput
    from cpgraph.runtime.graph_runner import GraphRunner

    passes = iter(("prefix", "extend"))

    def fwd(ids, meta, mla, index, **kw):
        if next(passes) == "prefix":
            return forward(ids, meta, mla, index, **kw)
        assert not any(kw.values()), kw
        p, n, b = meta.prefix_slots.shape[0], meta.kv_source.shape[0], meta.last_token_index.shape[0]
        runner = GraphRunner(lambda i, m: forward(i, m, mla, index).logits, max_requests=b + 2,
                             row_buckets=(ids.shape[0],), kv_buckets=(p + 24, n + 40), cp_size=cp_size,
                             capture=capture)  # fmt: skip
        bucket = runner.bucket_for(ids, meta)
        record.update(prefix_rows=(p, bucket.prefix_rows), kv_rows=(n, bucket.kv_rows), requests=(b, bucket.requests))
        logits = runner(ids, meta)
        record["captured"] = [r["captured"] for r in runner.capture_report()]
        return ForwardOutput(logits, None, None)

    return fwd


def job_padding(ctx, threads):
    """This rank's logits of the batch, as planned and padded, at each thread count."""
    from cp_model import compiled_cp, model_pair
    from torch._dynamo.utils import counters

    from cpgraph.runtime.engine import run_prefill

    _, model = model_pair()
    forward = compiled_cp(ctx, "aot_eager")
    prompts, kw = _prompts(), dict(prefix_lens=PREFIX_LENS, page_size=PAGE, rank=ctx.rank, cp_size=ctx.world_size)
    before = torch.get_num_threads()
    out = {}
    try:
        for n in threads:
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            plain = run_prefill(forward, model, prompts, **kw).logits.numpy().copy()
            graphs, t1 = counters["stats"]["unique_graphs"], time.perf_counter()
            record: dict = {}
            padded = run_prefill(through_runner(forward, ctx.world_size, record), model, prompts, **kw)
            record["new_graphs"] = counters["stats"]["unique_graphs"] - graphs
            record["seconds"] = (round(t1 - t0, 1), round(time.perf_counter() - t1, 1))
            out[n] = {"plain": plain, "padded": padded.logits.numpy().copy(), **record}
    finally:
        torch.set_num_threads(before)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_padded_prefix_equals_unpadded(world):
    results = shared_pool(world, CP_TIMEOUT_S).run(job_padding, THREADS)
    report = {}
    for rank, per_threads in enumerate(results):
        for n, r in per_threads.items():
            (p, p2), (kv, kv2), (b, b2) = r["prefix_rows"], r["kv_rows"], r["requests"]
            assert p2 > p > 0 and kv2 > kv and b2 > b, r  # every padded length grew
            assert r["padded"].shape == r["plain"].shape == (len(PROMPT_LENS), r["plain"].shape[1])
            diff = float(np.abs(r["padded"] - r["plain"]).max())
            assert diff <= ATOL, f"cp={world} rank {rank} threads {n}: padded logits differ by {diff}"
            report[(rank, n)] = (diff, r["new_graphs"], r["seconds"])
    print(f"\ncp={world}: P {results[0][1]['prefix_rows']}, N {results[0][1]['kv_rows']}; (rank, threads): (max "
          f"|padded - plain|, graphs compiled for the padded run, seconds plain/padded) {report}")  # fmt: skip


# ----------------------------------------------------------------- the same on GPUs, with capture
def _nccl_rank(rank: int, world: int, init_file: str, results) -> None:
    import torch.distributed as dist

    from dist_utils import RankContext

    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
        ctx = RankContext(rank, world, dist.group.WORLD.group_name)
        results.put((rank, True, tiny_model_job(ctx, "cuda", "inductor", capture=True)))
    except BaseException:
        import traceback

        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def tiny_model_job(ctx, device: str, backend: str, capture: bool):
    """One rank: the CP-compiled tiny model, planned vs padded (and, on a GPU, captured) extend pass."""
    import cpgraph
    from cpgraph.models import tiny_model
    from cpgraph.models.prefill import make_layout
    from cpgraph.runtime.engine import run_prefill

    model = tiny_model("tiny-deepseek-v32", device=device).eval()
    model.kv_layout = make_layout(model, "bf16", PAGE)
    cp = cpgraph.CPConfig(group=ctx.group_name, cp_size=ctx.world_size)
    forward = cpgraph.compile(model, cp, backend=backend, dynamic=True)
    prompts = [[t % model.config.vocab_size for t in p] for p in _prompts()]
    kw = dict(prefix_lens=PREFIX_LENS, page_size=PAGE, rank=ctx.rank, cp_size=ctx.world_size)
    with torch._dynamo.config.patch(recompile_limit=64):
        plain = run_prefill(forward, model, prompts, **kw).logits.float().cpu().numpy()
        record: dict = {}
        padded = run_prefill(through_runner(forward, ctx.world_size, record, capture), model, prompts, **kw)
    return {"plain": plain, "padded": padded.logits.float().cpu().numpy(), **record}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="CP with capture needs 2 GPUs (NCCL: one rank per GPU)")
def test_cuda_capture_pads_a_cached_prefix_under_cp(tmp_path):
    import torch.multiprocessing as mp

    world = 2
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_file = str(tmp_path / "nccl_init")
    procs = [ctx.Process(target=_nccl_rank, args=(r, world, init_file, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict((rank, (ok, value)) for rank, ok, value in (results.get(timeout=600) for _ in range(world)))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    failed = {r: v for r, (ok, v) in got.items() if not ok}
    assert not failed, "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failed.items())
    for rank, (_, r) in sorted(got.items()):
        assert r["captured"] == [True], r["captured"]
        (p, p2), (kv, kv2) = r["prefix_rows"], r["kv_rows"]
        assert p2 > p > 0 and kv2 > kv
        # Inductor's kernels for the padded shapes reduce in their own order: a tolerance, as on CPU.
        np.testing.assert_allclose(r["padded"], r["plain"], rtol=0, atol=1e-4, err_msg=f"rank {rank}")
