"""``--num-pages auto``: the KV pool takes what the memory leaves after the weights and one step's activations.

The arithmetic is checked against an independent reading of its parts: the
bytes a page costs come from a real ``KVPool`` (one page, every layer, the
draft's included), the activation booking from ``cpgraph.plan.memory`` with
the step's rows and the longest context, and the usable bytes are given (or
read from a host whose available memory is pinned).
"""

from __future__ import annotations

import pytest

from cpgraph.models import from_pretrained
from cpgraph.models.prefill import make_layout
from cpgraph.plan.memory import plan_memory
from cpgraph.runtime import kv_budget
from cpgraph.runtime.engine import pool_config
from cpgraph.runtime.kv_pool import KVPool
from cpgraph.runtime.kv_budget import pool_budget, usable_bytes

PAGE = 16


@pytest.fixture(scope="module")
def tiny():
    model = from_pretrained("tiny-glm5", draft=True).eval()
    model.kv_layout = make_layout(model, "bf16", PAGE)
    return model


def _page_bytes(model, kv_format, draft):
    return KVPool(pool_config(model, kv_format, PAGE, 1, 0, draft=draft)).bytes_per_page()


@pytest.mark.parametrize("name,kv_format,draft,graphs", [("tiny-glm5", "bf16", False, False),
                                                        ("tiny-deepseek-v32-fp8", "fp8", True, False),
                                                        ("tiny-glm5", "bf16", True, True)])
def test_pages_are_what_is_left_after_the_activations(name, kv_format, draft, graphs):
    model = from_pretrained(name, draft=draft).eval()
    usable = 3 << 30
    b = pool_budget(model, page_size=PAGE, kv_format=kv_format, token_budget=512, max_context=4096,
                    cuda_graphs=graphs, draft=draft, usable=usable)
    act = plan_memory(model.config, tokens=4096, row_bucket=512, dtype="fp32", kv_format=kv_format,
                      page_size=PAGE).activation_peak * (2 if graphs else 1)
    per_page = _page_bytes(model, kv_format, draft)
    if draft:
        assert per_page > _page_bytes(model, kv_format, False)  # the draft's layer is one more layer a page
    assert (b.bytes_per_page, b.activation_bytes) == (per_page, act)
    assert b.pages == (usable - act) // per_page and b.pages * per_page + act <= usable
    assert "pages per rank" in b.line()


def test_a_longer_context_or_budget_books_more(tiny):
    small = pool_budget(tiny, page_size=PAGE, kv_format="bf16", token_budget=256, max_context=1024, usable=1 << 30)
    big = pool_budget(tiny, page_size=PAGE, kv_format="bf16", token_budget=4096, max_context=32768, usable=1 << 30)
    assert big.activation_bytes > small.activation_bytes and big.pages < small.pages


def test_no_room_is_one_line(tiny):
    with pytest.raises(ValueError, match="no room for a KV pool") as err:
        pool_budget(tiny, page_size=PAGE, kv_format="bf16", token_budget=512, max_context=4096, usable=1 << 20)
    assert "\n" not in str(err.value)


def test_cpu_usable_is_the_fraction_of_the_available_host_memory(monkeypatch):
    import cpgraph.models.memory_check as mc

    monkeypatch.setattr(mc, "_host_available", lambda: 10 << 30)
    assert usable_bytes("cpu", 0.25) == (10 << 30) // 4
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            usable_bytes("cpu", bad)
    monkeypatch.setattr(mc, "_host_available", lambda: None)
    with pytest.raises(ValueError, match="give --num-pages"):
        usable_bytes("cpu", 0.5)


def test_the_served_engine_gets_the_auto_pool(tiny, monkeypatch):
    """``cpgraph serve --num-pages auto`` on one device: the spec's pages come from the budget, the engine's pool
    holds that many, and the flags are checked with one line each."""
    import cpgraph.models.memory_check as mc
    from cpgraph.cli import build_parser, main
    from cpgraph.cli_serve import spec_from_args
    from cpgraph.serve.node import auto_pages, build_engine, make_forward

    spec = spec_from_args(build_parser().parse_args(["serve", "--model", "tiny-glm5", "--num-pages", "auto",
                                                     "--kv-memory-fraction", "0.5", "--device", "cpu"]))
    assert spec.num_pages is None and spec.kv_memory_fraction == 0.5
    model = from_pretrained("tiny-glm5").eval()
    model.kv_layout = make_layout(model, "bf16", PAGE)
    monkeypatch.setattr(mc, "_host_available", lambda: 512 << 20)  # 256 MiB usable
    pages = auto_pages(model, spec)
    want = pool_budget(model, page_size=PAGE, kv_format="bf16", token_budget=spec.token_budget,
                       max_context=model.config.max_position_embeddings, usable=256 << 20)
    assert pages == want.pages > 0
    from dataclasses import replace

    engine = build_engine(model, make_forward(model, spec), replace(spec, num_pages=pages))
    assert engine.cache.pool.config.num_pages == pages
    for argv, msg in ((["--kv-memory-fraction", "0.5"], "--kv-memory-fraction applies to --num-pages auto"),
                      (["--num-pages", "auto", "--kv-memory-fraction", "2"], "--kv-memory-fraction must be in (0, 1]"),
                      (["--num-pages", "lots"], "expected a page count or auto")):
        assert main(["serve", "--model", "tiny-glm5", *argv]) == 2


def test_ranks_agree_on_the_smallest(monkeypatch):
    calls = []

    def fake_all_reduce(t, op=None, group=None):
        calls.append((int(t.item()), op, group))
        t.fill_(min(int(t.item()), 700))  # another rank had 700

    import torch.distributed as dist

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    assert kv_budget.agree_pages(1000, group="ctl") == 700
    assert calls == [(1000, dist.ReduceOp.MIN, "ctl")]
