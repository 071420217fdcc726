"""Deterministic prefill under CP on CPU: two gloo ranks give every request the one-device bits, logits and KV.

Each rank compiles the model once (``aot_eager``, ``CPConfig(cp_size=2,
deterministic=True)``) and prefills a batch of four requests of mixed
lengths; one graph, the pass without a cached prefix, to keep the CI time
(the graph over a cached prefix is compiled in-process by
``test_deterministic_prefill.py`` and under CP by the NCCL test; CP over a
cached prefix with the mode's CPU kernels is ``passes/test_cp_numerics.py``).
The reference is the eager model on one device in deterministic mode: every
request's logits, and every KV page of the followed request (each rank holds
the pages it owns), equal it bit for bit -- and the followed request's equal
its run alone.  The CP
ranks compute fewer rows per product than one device and run at the rank
thread count; the mode makes neither matter (docs/deterministic.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import det_model as dm  # noqa: E402
from cp_model import CP_TIMEOUT_S  # noqa: E402
from dist_utils import shared_pool  # noqa: E402

pytestmark = pytest.mark.slow

TARGET, OTHERS = dm.prompts()
O0, O1, O2, O3 = OTHERS
BATCH = ([O3, O0, TARGET, O2], [0, 0, 0, 0], 2)  # four requests (a batch of one would be a graph of its own)


def job_deterministic_cp(ctx, batch):
    """This rank's CP run of ``batch``: logits, and the followed request's KV bytes on the pages it owns."""
    sys.path.insert(0, str(HERE))
    from cp_model import use_numerics_compile_settings

    from cpgraph.passes import CPConfig, compile
    from cpgraph.runtime.engine import run_prefill

    use_numerics_compile_settings()
    prompts, prefix, i = batch
    model = dm.build()
    fn = compile(model, CPConfig(group=ctx.group_name, cp_size=ctx.world_size, deterministic=True),
                 backend="aot_eager", dynamic=True)

    def forward(ids, meta, mla, index, **kw):
        return fn(ids, meta, mla, index, **kw)

    res = run_prefill(forward, model, prompts, prefix_lens=prefix, page_size=dm.PAGE, rank=ctx.rank,
                      cp_size=ctx.world_size)
    return res.logits.float().numpy().copy(), dm.owned_page_records(model, res, i, len(prompts[i]))


def test_cp2_equals_one_device_bit_for_bit():
    from cpgraph.ops.invariant_mode import deterministic
    from cpgraph.runtime.engine import run_prefill

    pending = shared_pool(2, CP_TIMEOUT_S).submit(job_deterministic_cp, BATCH)
    prompts, prefix, i = BATCH
    model = dm.build()
    with deterministic():
        single = run_prefill(dm.eager(model), model, prompts, prefix_lens=prefix, page_size=dm.PAGE)
        alone = run_prefill(dm.eager(model), model, [TARGET], page_size=dm.PAGE)
    records = dm.request_records(model, single, i, len(TARGET))
    assert torch.equal(single.logits[i], alone.logits[0])
    assert dm.same_records(records, dm.request_records(model, alone, 0, len(TARGET)))
    ranks = pending.result()
    want = single.logits.float().numpy()
    pages = {}
    for r, (logits, owned) in enumerate(ranks):
        assert np.array_equal(logits, want), f"rank {r}: CP logits differ from one device"
        assert not set(owned) & set(pages), "a page held by two ranks"
        pages.update(owned)
    assert sorted(pages) == list(range(-(-len(TARGET) // dm.PAGE)))
    assert all(len(owned) for _, owned in ranks)  # both ranks own pages of the request
    for page, got in pages.items():
        assert dm.same_records(got, dm.page_records(records, page)), f"KV page {page} differs from one device"
