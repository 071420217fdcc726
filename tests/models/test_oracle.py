"""cpgraph models against transformers 5.24 (fp32, CPU, seeded tiny random configs).

Two configs per model type (see ``hf_oracle.config_variants``): 4 vs 2
attention heads, top-k 16 vs 8, yarn vs default RoPE, GLM IndexCache
patterns F S F S and F F S S; plus three configs with 1-2 indexer heads,
whose scores tie exactly (ReLU zeros, negative head weights), for the top-k
tie rule.  transformers' indexer top-k is patched to the same rule
(``hf_oracle.tie_rule_topk``).  Prompt lengths 5 and 12 are shorter than
top-k (or close), 37 and 50 longer, so both the "attend to everything" and
the truly sparse regime are covered.
"""

from __future__ import annotations

import pytest
import torch

from cpgraph.models import prefill, prefill_logits

from hf_oracle import TopkCapture, cached_pair, prompts

VARIANTS = ["ds-a", "ds-b", "glm-a", "glm-b", "ds-tie1", "ds-tie2", "glm-tie2"]
TIE_VARIANTS = {"ds-tie1", "ds-tie2", "glm-tie2"}  # 1-2 indexer heads: exact score ties are common
LENS = [5, 12, 37, 50]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module", params=VARIANTS)
def oracle(request):
    """(name, hf, model, prompts, batched prefill result, HF runs per prompt)."""
    hf, model = cached_pair(request.param)
    ps = prompts(model.config.vocab_size, LENS, seed=7)
    res = prefill(model, ps, return_topk=True)
    cap = TopkCapture(hf)
    runs = [cap.run(p) for p in ps]
    return request.param, hf, model, ps, res, runs


def test_logits_match_hf(oracle):
    name, _, model, ps, res, runs = oracle
    assert res.logits.dtype == torch.float32 and res.logits.shape == (len(ps), model.config.vocab_size)
    for i, (hf_logits, _, _) in enumerate(runs):
        err = rel_err(res.logits[i], hf_logits)
        assert err <= 1e-4, f"{name} prompt {i} (len {len(ps[i])}): relative error {err:.2e}"


def _check_row_sets(mine: set, theirs: set, scores: torch.Tensor, k: int, row: int, where: str) -> bool:
    """Compare two top-k sets of one query row; keys within the score margin of the k-th are ties.

    Returns True when the row had ambiguous (tied) keys at the boundary.
    """
    window = scores[: row + 1]
    if row + 1 <= k:  # everything causal is selected
        assert mine == theirs == set(range(row + 1)), where
        return False
    assert len(mine) == len(theirs) == k, where
    kth = window.topk(k).values[-1]
    eps = 1e-5 * max(1.0, float(kth.abs()))
    sure_in = set(torch.nonzero(window > kth + eps).flatten().tolist())
    sure_out = set(torch.nonzero(window < kth - eps).flatten().tolist())
    assert sure_in <= mine and sure_in <= theirs, f"{where}: a clearly selected key is missing"
    assert not (mine & sure_out) and not (theirs & sure_out), f"{where}: a clearly rejected key was selected"
    ambiguous = len(sure_in) + len(sure_out) < row + 1
    if not ambiguous:
        assert mine == theirs, where
    return ambiguous


def test_topk_sets_match_hf(oracle):
    name, _, model, ps, res, runs = oracle
    cfg = model.config
    k = cfg.index_topk
    ks = res.meta.ks
    row0 = 0
    checked = 0
    for i, (_, hf_scores, hf_used) in enumerate(runs):
        n = len(ps[i])
        for layer in range(cfg.num_hidden_layers):
            mine_all = res.topk[layer][row0 : row0 + n]
            for s in range(n):
                ids = mine_all[s]
                mine = set((ids[ids >= 0] - ks[row0 + s]).tolist())
                theirs = set(t for t in hf_used[layer][s].tolist() if t <= s)  # HF pads with masked keys
                src = layer
                while cfg.indexer_types[src] == "shared":
                    src -= 1
                _check_row_sets(mine, theirs, hf_scores[src][s], k, s, f"{name} prompt {i} layer {layer} row {s}")
                checked += 1
        row0 += n
    assert checked == sum(len(p) for p in ps) * cfg.num_hidden_layers


def test_topk_and_logits_equal_hf_under_tie_rule(oracle):
    """Same tie rule on both sides: identical selections (not just tie-tolerant sets), logits to ~1e-6.

    Rows whose boundary scores differ but lie within fp32 rounding of each
    other may still flip (the two sides sum heads in different orders);
    those are counted and must stay rare.  Exactly tied rows must agree.
    """
    name, _, model, ps, res, runs = oracle
    cfg = model.config
    k = cfg.index_topk
    ks = res.meta.ks
    row0 = exact_ties = near = rows = 0
    for i, (hf_logits, hf_scores, hf_used) in enumerate(runs):
        n = len(ps[i])
        err = rel_err(res.logits[i], hf_logits)
        assert err <= 1e-5, f"{name} prompt {i}: relative error {err:.2e}"
        for layer in cfg.indexer_layers:
            for s in range(n):
                ids = res.topk[layer][row0 + s]
                mine = set((ids[ids >= 0] - ks[row0 + s]).tolist())
                theirs = set(t for t in hf_used[layer][s].tolist() if t <= s)
                rows += 1
                window = hf_scores[layer][s][: s + 1]
                if s + 1 > k:
                    top = window.sort(descending=True).values
                    kth, nxt = float(top[k - 1]), float(top[k])
                    exact_ties += kth == nxt
                    if kth != nxt and kth - nxt <= 1e-5 * max(1.0, abs(kth)):
                        near += 1
                        continue
                assert mine == theirs, f"{name} prompt {i} layer {layer} row {s}: {sorted(mine ^ theirs)}"
        row0 += n
    assert near <= 0.02 * rows, f"{name}: {near} of {rows} rows had near ties"
    if name in TIE_VARIANTS:
        assert exact_ties >= 10, f"{name}: only {exact_ties} rows tie exactly at the top-k boundary"


def test_shared_layers_reuse_previous_topk(oracle):
    name, _, model, ps, res, runs = oracle
    cfg = model.config
    shared = [i for i, t in enumerate(cfg.indexer_types) if t == "shared"]
    if not shared:  # DeepSeek-V3.2: every layer runs (and stores keys for) its own indexer
        assert cfg.model_type == "deepseek_v32"
        assert cfg.indexer_layers == tuple(range(cfg.num_hidden_layers))
        assert all(layer.self_attn.indexer is not None for layer in model.model.layers)
    for layer in shared:
        # cpgraph: the very same selection as the layer before ...
        assert torch.equal(res.topk[layer], res.topk[layer - 1])
        # ... which is what transformers does too.
        for _, _, hf_used in runs:
            assert torch.equal(hf_used[layer], hf_used[layer - 1])
        attn = model.model.layers[layer].self_attn
        assert attn.indexer is None
        assert not [n for n, _ in attn.named_parameters() if "indexer" in n]
    # Index-K storage only for indexer layers: bytes = pages * page * (MLA everywhere + index keys where active).
    pages = sum(-(-len(p) // 16) for p in ps)
    per_token = cfg.num_hidden_layers * cfg.kv_record_dim * 4 + len(cfg.indexer_layers) * cfg.index_head_dim * 4
    assert res.kv_bytes == pages * 16 * per_token
    assert len(cfg.indexer_layers) == cfg.num_hidden_layers - len(shared)


def test_hidden_states_output():
    from cpgraph.models import KVLayout, build_batch
    from cpgraph.plan import plan_prefill
    from cpgraph.runtime.kv_pool import KVPool, KVPoolConfig

    _, model = cached_pair("ds-a")
    cfg = model.config
    ps = prompts(cfg.vocab_size, [9, 30], seed=8)
    pool = KVPool(KVPoolConfig(cfg.num_hidden_layers, 16, 3, "dense", cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                               cfg.index_head_dim, cfg.indexer_layers, torch.float32))
    tables = [pool.alloc_pages_with_owners([0]), pool.alloc_pages_with_owners([0, 0])]
    ids, meta = build_batch(plan_prefill([0, 0], [9, 30], cp_size=1, page_size=16, row_align=16), ps, tables)
    mla = [pool.mla_pool(i) for i in range(cfg.num_hidden_layers)]
    idx = [pool.index_pool(i) for i in cfg.indexer_layers]
    with torch.no_grad():
        out = model(ids, meta, mla, idx, KVLayout("dense", 16), return_hidden=True)
        # Valid tokens only, in global order: the 9 + 30 extend tokens, no padding rows.
        assert out.hidden.shape == (39, cfg.hidden_size) and out.topk is None
        from_hidden = model.lm_head(out.hidden[meta.last_token_index]).float()
    assert torch.allclose(from_hidden, out.logits, rtol=1e-5, atol=1e-5)
    assert torch.allclose(out.logits, prefill_logits(model, ps), rtol=1e-5, atol=1e-5)


def test_chunked_prefill_equals_one_shot():
    hf, model = cached_pair("glm-b")
    ps = prompts(model.config.vocab_size, [37, 50, 20, 9], seed=3)
    one_shot = prefill_logits(model, ps)
    chunked = prefill_logits(model, ps, prefix_lens=[16, 32, 16, 0])
    assert rel_err(chunked, one_shot) <= 1e-5


def test_chunked_prefill_equals_one_shot_deepseek():
    _, model = cached_pair("ds-a")
    ps = prompts(model.config.vocab_size, [50, 33], seed=4)
    assert rel_err(prefill_logits(model, ps, prefix_lens=[48, 32]), prefill_logits(model, ps)) <= 1e-5


@pytest.mark.parametrize("name", ["ds-b", "glm-a"])
def test_batch_equals_each_request_alone(name):
    _, model = cached_pair(name)
    ps = prompts(model.config.vocab_size, [23, 5, 41], seed=5)
    batch = prefill_logits(model, ps)
    for i, p in enumerate(ps):
        alone = prefill_logits(model, [p])
        assert rel_err(batch[i], alone[0]) <= 1e-5, f"prompt {i}"


def test_dummy_rows_do_not_change_results():
    """Static padding rows (row_align) never write KV, never route, and do not change logits."""
    from cpgraph.models import KVLayout, build_batch
    from cpgraph.plan import plan_prefill
    from cpgraph.runtime.kv_pool import KVPool, KVPoolConfig

    _, model = cached_pair("glm-a")
    cfg = model.config
    ps = prompts(cfg.vocab_size, [7, 19], seed=6)
    outs = []
    for align in (1, 64):
        pool = KVPool(
            KVPoolConfig(cfg.num_hidden_layers, 16, 8, "dense", cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                         cfg.index_head_dim, cfg.indexer_layers, torch.float32)
        )
        tables = [pool.alloc_pages_with_owners([0] * 1), pool.alloc_pages_with_owners([0] * 2)]
        plan = plan_prefill([0, 0], [7, 19], cp_size=1, page_size=16, row_align=align)
        ids, meta = build_batch(plan, ps, tables)
        assert (meta.row_slots == -1).sum() == plan.num_rows - 26
        mla = [pool.mla_pool(i) for i in range(cfg.num_hidden_layers)]
        idx = [pool.index_pool(i) for i in cfg.indexer_layers]
        with torch.no_grad():
            outs.append((model(ids, meta, mla, idx, KVLayout("dense", 16)).logits, [m.clone() for m in mla]))
    assert rel_err(outs[1][0], outs[0][0]) <= 1e-6
    for a, b in zip(outs[0][1], outs[1][1]):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
