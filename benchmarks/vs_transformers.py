"""cpgraph vs transformers on one GPU: same weights, same prompts, latency, memory and logit agreement.

Model: DeepSeek-V3.2 architecture with production-shaped attention (the kernel-shaped config of
``cuda_graph_bench.py``: 64 heads, kv_lora 512, rope 64, indexer 64 x 128, top-k 2048, 4 layers:
1 dense + 3 MoE), bf16.  transformers' ``DeepseekV32ForCausalLM`` (eager attention) gets seeded
random weights; ``cpgraph.models.from_hf`` converts it, so both hold the same tensors (router,
correction bias and indexer weights_proj kept in fp32 on both sides, as the checkpoints do).

Cases (``--cases``): ``1x2K``, ``1x8K``, ``8x1K`` (B requests x new tokens), ``8x32@4K`` (8 requests
x 32 new tokens over a 4K cached prefix; transformers uses its own KV cache, filled by a chunked
prefill that is not timed), and cpgraph alone ``1x32K``, ``1x128K``.  Per case and side: median ms
of the timed forward, new tokens/s, peak GPU memory (weights included), and for the shared cases
the speed ratio and last-token logit agreement (max |diff|, top-1 agreement).  The forward's
useful FLOPs (sparse attention over the selected keys, indexer over the causal window, routed
experts only, see :func:`forward_flops`) are set against a dense bf16 GEMM measured in the same
run.  The cpgraph side reports eager, ``cpgraph.compile`` (Inductor, CP size 1), and both replayed
from CUDA graphs by ``cpgraph.runtime.graph_runner.GraphRunner`` (``graphed``, ``compiled-graphed``;
docs/cuda_graphs.md), and takes the fastest.

Reading the agreement: with random weights the indexer's scores are nearly tied, so once a
query's window is longer than ``index_topk`` (2048) bf16 rounding alone changes which keys are
selected and the logits move by O(1) on both sides of any correct implementation; the exact
fp32 top-k comparison is the CPU oracle test.  Where every window fits in the top-k (``1x2K``,
``8x1K``) the two sides should agree to bf16 noise.  transformers' RoPE ``inv_freq`` buffers are
kept in fp32 (a plain ``.to(bf16)`` of the reference model rounds them to bf16, 0.28 % off, which
moved single requests' logits by up to 1.3-2.3 through MoE routing flips: the old 8x1K gap).
``--diagnose CASE`` dissects a case's agreement (per request, per provider, fp32 on both sides).

Needs only torch, triton and transformers (>= 5.13: ``DeepseekV32ForCausalLM``)::

    python benchmarks/vs_transformers.py [--cases 1x2K,8x1K] [--modes eager,graphed] [--profile 1x8K]
        [--diagnose 8x1K] [--json out.json]       # --device cpu: a dry run at tiny shapes
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_graph_bench import KERNEL_SHAPED  # noqa: E402

FP32_KEPT = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")


@dataclass(frozen=True)
class Case:
    name: str
    requests: int
    extend: int
    prefix: int = 0
    cpgraph_only: bool = False


CASES = {
    c.name: c
    for c in (
        Case("1x2K", 1, 2048),
        Case("1x8K", 1, 8192),
        Case("8x1K", 8, 1024),
        Case("8x32@4K", 8, 32, prefix=4096),
        Case("1x32K", 1, 32768, cpgraph_only=True),
        Case("1x128K", 1, 131072, cpgraph_only=True),
    )
}


# ------------------------------------------------------------------ helpers
def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


DEVICE = "cuda"  # --device cpu: a dry run of the whole script at tiny shapes (wall-clock timing, no memory stats)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, repeat: int, setup=None, warmup: int = 2) -> float:
    """Median ms of ``fn()`` between CUDA events; ``setup()`` runs untimed before each call."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    sync()
    samples = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        sync()
        if DEVICE != "cuda":
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        samples.append(a.elapsed_time(b))
    return statistics.median(samples)


def dense_gemm_tflops(n: int = 8192, repeat: int = 10) -> float:
    n = n if DEVICE == "cuda" else 256
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, repeat, warmup=3)
    del a, b
    return 2 * n**3 / (ms * 1e-3) / 1e12


def flops_parts(cfg, requests: int, extend: int, prefix: int = 0) -> dict[str, float]:
    """Useful FLOPs of one forward by part (multiply-add = 2); :func:`forward_flops` is their sum.

    Per token and layer: the projections (MLA q/kv/absorb/W_UV/o, indexer q/k/weights), the
    indexer logits over the causal window, sparse MLA over ``min(topk, window)`` keys at
    ``2 * H * (kv_lora + rope + kv_lora)`` per key, the dense MLP or the router plus the routed
    top-k and shared experts; plus one lm_head row per request.
    """
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    ql, kl, r = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    ih, idim = cfg.index_n_heads, cfg.index_head_dim
    windows = torch.arange(prefix + 1, prefix + extend + 1, dtype=torch.float64)
    sum_window = float(windows.sum()) * requests
    sum_sel = float(windows.clamp(max=cfg.index_topk).sum()) * requests
    T = requests * extend
    parts = dict.fromkeys(("projections", "sparse_mla", "indexer_projections", "indexer_logits", "dense_mlp",
                           "router", "routed_experts", "shared_experts", "lm_head"), 0.0)  # fmt: skip
    for i in range(cfg.num_hidden_layers):
        parts["projections"] += T * 2 * (H * ql + ql * nh * (nope + r) + H * (kl + r) + nh * nope * kl
                                         + nh * kl * v + nh * v * H)  # fmt: skip
        parts["sparse_mla"] += sum_sel * 2 * nh * (kl + r + kl)
        if cfg.indexer_types[i] == "full":
            parts["indexer_projections"] += T * 2 * (ql * ih * idim + H * idim + H * ih)
            parts["indexer_logits"] += sum_window * 2 * ih * idim
        if cfg.mlp_layer_types[i] == "sparse":
            I = cfg.moe_intermediate_size
            parts["router"] += T * 2 * H * cfg.n_routed_experts
            parts["routed_experts"] += T * cfg.num_experts_per_tok * 6 * H * I
            parts["shared_experts"] += T * cfg.n_shared_experts * 6 * H * I
        else:
            parts["dense_mlp"] += T * 6 * H * cfg.intermediate_size
    parts["lm_head"] = requests * 2 * H * cfg.vocab_size
    return parts


def forward_flops(cfg, requests: int, extend: int, prefix: int) -> float:
    """Useful FLOPs of one extend forward (multiply-add = 2), the work a sparse prefill must do: :func:`flops_parts` summed."""
    return sum(flops_parts(cfg, requests, extend, prefix).values())


def agreement(ours: torch.Tensor, theirs: torch.Tensor) -> dict:
    ours, theirs = ours.float(), theirs.float()
    return {
        "max_abs_diff": (ours - theirs).abs().max().item(),
        "logit_scale": theirs.abs().max().item(),
        "top1_agree": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
    }


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0


def reset_peak() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ------------------------------------------------------------------- models
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
            qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, index_n_heads=4, index_head_dim=32, index_topk=64,
            moe_intermediate_size=32, intermediate_size=128, vocab_size=512)  # fmt: skip
TINY_CASES = {"1x2K": 128, "1x8K": 256, "8x1K": 48, "8x32@4K": 8, "1x32K": 512, "1x128K": 1024}  # extend per case
TINY_PREFIX = 128


def build_models(seed: int = 0, device: str = "cuda", overrides: dict | None = None):
    """``(hf_model or None, cpgraph_model, config dict, why_no_hf)`` on ``device``, same bf16 weights."""
    import transformers

    from cpgraph.models import DSAConfig, build_model, from_hf, init_random
    from cpgraph.models.config import bundled_config_dict

    d = {**bundled_config_dict("tiny-deepseek-v32"), **KERNEL_SHAPED, **(overrides or {})}
    donor = init_random(build_model(DSAConfig.from_hf_dict(d)), seed=seed, std=0.02)
    hf_cls = getattr(transformers, "DeepseekV32ForCausalLM", None)
    if hf_cls is None:
        why = f"transformers {transformers.__version__} has no DeepseekV32ForCausalLM"
        model = donor.to(device=device, dtype=torch.bfloat16)
        for name, p in model.named_parameters():
            if name.endswith(FP32_KEPT):
                p.data = p.data.float()
        return None, model.eval(), d, why
    kw = {k: val for k, val in d.items() if k not in ("model_type", "architectures", "torch_dtype", "dtype")}
    hf_cfg = transformers.DeepseekV32Config(**kw)
    hf_cfg._attn_implementation = "eager"
    with torch.device(device):
        hf = hf_cls(hf_cfg)
    result = hf.load_state_dict(donor.state_dict(), strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise RuntimeError(f"weight names differ: missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}")
    # ``.to(bf16)`` would also round transformers' RoPE ``inv_freq`` buffers to bf16 (up to 0.28 %
    # relative error: angles off by radians at 8K positions), which a checkpoint loaded with
    # ``from_pretrained(dtype=bf16)`` keeps in fp32.  Keep them fp32, as loading does.
    rope = {name: b.detach().clone() for name, b in hf.named_buffers() if name.endswith("inv_freq")}
    hf = hf.to(torch.bfloat16).eval()
    for name, b in hf.named_buffers():
        if name in rope:
            b.data = rope[name].to(device)
    donor_state = donor.state_dict()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(FP32_KEPT):
                p.data = donor_state[name].to(device=device, dtype=torch.float32)
        for name, b in hf.named_buffers():
            if name.endswith(FP32_KEPT):
                b.data = donor_state[name].to(device=device, dtype=torch.float32)
    model = from_hf(hf, device=device).eval()
    return hf, model, d, None


# ------------------------------------------------------------------ cpgraph
MODES = ("eager", "compiled", "graphed", "compiled-graphed")


class CpgraphRunner:
    """The cpgraph side: eager, ``cpgraph.compile`` (Inductor), and both replayed from CUDA graphs.

    ``graphed`` / ``compiled-graphed`` run through :class:`cpgraph.runtime.graph_runner.GraphRunner`:
    the batch is planned with ``row_align`` = its row bucket, the KV view padded to its bucket,
    one graph captured per bucket on first use (warm-up and capture are not timed; their cost is
    reported per bucket), then every timed call replays it.
    """

    def __init__(self, model, page: int, modes: list[str], max_requests: int = 8):
        from cpgraph.models.prefill import make_layout

        self.model = model
        self.page = page
        model.kv_layout = make_layout(model, "bf16", page)
        self.compiled = None
        if {"compiled", "compiled-graphed"} & set(modes):
            from cpgraph.passes import CPConfig, compile

            self.compiled = compile(model, CPConfig())
        self.modes = modes
        self.max_requests = max_requests
        self.pools = None
        self.graphs = {}

    def make_graph_runners(self, modes) -> None:
        """Fresh runners for a fresh pool: a captured graph binds the pool tensors' addresses."""
        from cpgraph.runtime.graph_runner import GraphRunner

        mla, index = self.pools
        fwd = lambda f: lambda ids, meta: f(ids, meta, mla, index).logits  # noqa: E731
        self.graphs = {}
        if "graphed" in modes:
            self.graphs["graphed"] = GraphRunner(fwd(self.model), max_requests=self.max_requests)
        if "compiled-graphed" in modes:
            self.graphs["compiled-graphed"] = GraphRunner(fwd(self.compiled), max_requests=self.max_requests)

    def setup(self, prompts, prefix: int):
        """Pool, page tables and the cached prefix (filled eagerly, one request at a time, not timed)."""
        from cpgraph.models import build_batch
        from cpgraph.plan import plan_prefill
        from cpgraph.runtime.engine import pool_config, pool_tensors
        from cpgraph.runtime.kv_pool import KVPool

        model, ps = self.model, self.page
        pages = [math.ceil(len(p) / ps) for p in prompts]
        pool = KVPool(pool_config(model, "bf16", ps, sum(pages)))
        tables = [pool.alloc_pages_with_owners([0] * n) for n in pages]
        mla, index = pool_tensors(pool, model)
        for t in mla + index:
            torch._dynamo.mark_static_address(t)
        self.pools = (mla, index)
        if prefix:
            for i in range(len(prompts)):
                pre = plan_prefill([0], [prefix], cp_size=1, page_size=ps)
                ids, meta = build_batch(pre, [prompts[i][:prefix]], [tables[i][: prefix // ps]], model.device,
                                        prefix_page_owners=[[]])  # fmt: skip
                model(ids, meta, mla, index)
        return pool, tables

    def batch(self, prompts, prefix: int, tables, graph_runner=None):
        from cpgraph.models import build_batch
        from cpgraph.plan import plan_prefill

        B, E = len(prompts), len(prompts[0]) - prefix
        if graph_runner is not None:
            plan = graph_runner.plan([prefix] * B, [E] * B, self.page)
        else:
            plan = plan_prefill([prefix] * B, [E] * B, cp_size=1, page_size=self.page)
        return build_batch(plan, [p[prefix:] for p in prompts], tables, self.model.device)

    @torch.no_grad()
    def logits(self, prompts, prefix: int = 0) -> torch.Tensor:
        """Eager last-token logits of one batch on a fresh pool (diagnostics)."""
        pool, tables = self.setup(prompts, prefix)
        ids, meta = self.batch(prompts, prefix, tables)
        out = self.model(ids, meta, *self.pools).logits.float()
        del pool
        self.pools = None
        return out

    @torch.no_grad()
    def run(self, prompts, prefix: int, repeat: int, modes=None, profile: bool = False) -> dict:
        reset_peak()
        pool, tables = self.setup(prompts, prefix)
        mla, index = self.pools
        modes = modes or self.modes
        self.make_graph_runners(modes)
        out, logits = {}, None
        for mode in modes:
            gr = self.graphs.get(mode)
            ids, meta = self.batch(prompts, prefix, tables, gr)
            if gr is not None:
                fn = lambda: gr(ids, meta)  # noqa: E731
            else:
                f = self.compiled if mode == "compiled" else self.model
                fn = lambda: f(ids, meta, mla, index).logits  # noqa: E731
            gc.collect()
            reset_peak()
            t0 = time.perf_counter()
            got = fn().float()
            sync()
            first_s = time.perf_counter() - t0
            ms = time_ms(fn, repeat, warmup=1 if repeat <= 2 else 2)
            out[mode] = {"ms": ms, "first_call_s": first_s, "peak_gib": peak_gib(), "rows": int(ids.shape[0])}
            if gr is not None:
                out[mode]["capture"] = [r for r in gr.capture_report() if r["rows"] == ids.shape[0]]
            if logits is None:
                logits = got
            else:
                out[mode]["max_abs_diff_vs_first"] = (got - logits).abs().max().item()
            log(f"  {mode}: {json.dumps(out[mode])}")
        best = min(out, key=lambda m: out[m]["ms"])
        res = {"modes": out, "best_mode": best, "ms": out[best]["ms"], "peak_gib": out[best]["peak_gib"]}
        if profile:
            prof_mode = "compiled" if "compiled" in out else "eager"
            f = self.compiled if prof_mode == "compiled" else self.model
            ids, meta = self.batch(prompts, prefix, tables)
            res["profile"] = profile_top(lambda: f(ids, meta, mla, index).logits, prof_mode)
        del pool, mla, index, fn
        self.pools, self.graphs = None, {}
        return res, logits


def profile_top(fn, label: str, rows: int = 12) -> dict:
    """Top GPU kernels of one call (torch.profiler), plus GPU-busy vs wall time (host-bound check)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        sync()
        wall = (time.perf_counter() - t0) * 1e3
    kernels = [e for e in prof.key_averages() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    attr = "device_time_total" if hasattr(kernels[0] if kernels else None, "device_time_total") else "cuda_time_total"
    kernels.sort(key=lambda e: getattr(e, attr), reverse=True)
    busy = sum(getattr(e, attr) for e in kernels) / 1e3
    top = [{"kernel": e.key[:90], "ms": getattr(e, attr) / 1e3, "calls": e.count,
            "share": getattr(e, attr) / 1e3 / busy if busy else 0.0} for e in kernels[:rows]]  # fmt: skip
    log(f"  profile ({label}): wall {wall:.1f} ms, GPU busy {busy:.1f} ms, {sum(e.count for e in kernels)} kernels")
    for t in top:
        log(f"    {t['ms']:8.2f} ms {100 * t['share']:5.1f}% x{t['calls']:<5} {t['kernel']}")
    return {"mode": label, "wall_ms": wall, "gpu_busy_ms": busy, "kernels": sum(e.count for e in kernels), "top": top}


# -------------------------------------------------------------- transformers
@torch.no_grad()
def run_hf(hf, prompts, prefix: int, repeat: int, prefix_chunk: int = 1024) -> tuple[dict, torch.Tensor]:
    from transformers import DynamicCache

    dev = hf.device
    reset_peak()
    if not prefix:
        ids = torch.tensor(prompts, device=dev)
        fn = lambda: hf(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1]  # noqa: E731
        setup = None
    else:
        cache = DynamicCache(config=hf.config)
        for s in range(0, prefix, prefix_chunk):  # chunked: bounds transformers' dense score tensors
            chunk = torch.tensor([p[s : min(s + prefix_chunk, prefix)] for p in prompts], device=dev)
            hf(input_ids=chunk, past_key_values=cache, use_cache=True, logits_to_keep=1)
        ids = torch.tensor([p[prefix:] for p in prompts], device=dev)
        state = {}

        def setup():
            state["cache"] = None
            state["cache"] = copy.deepcopy(cache)

        def fn():
            return hf(input_ids=ids, past_key_values=state["cache"], use_cache=True, logits_to_keep=1).logits[:, -1]

    reset_peak()
    if setup is not None:
        setup()
    logits = fn().float()
    ms = time_ms(fn, repeat, setup=setup, warmup=1)
    return {"ms": ms, "peak_gib": peak_gib()}, logits


# -------------------------------------------------------------- diagnosis
@torch.no_grad()
def hf_logits(hf, prompts) -> torch.Tensor:
    ids = torch.tensor(prompts, device=hf.device)
    return hf(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1].float()


@torch.no_grad()
def diagnose_agreement(hf, runner: CpgraphRunner, prompts) -> dict:
    """Where a batch's last-token logits differ from transformers: per request, per provider, fp32.

    Compares (a) both sides batched, (b) both sides one request at a time, (c) each side batched vs
    its own per-request run, (d) cpgraph with one op at a time forced to the torch reference
    (``CPGRAPH_PROVIDERS=op:reference``), (e) the indexer's logits budget raised so it scores all
    rows in one chunk, and (f) both sides in fp32 (cpgraph on the reference providers).
    """
    import os

    from cpgraph.models.prefill import make_layout

    def safe(key, fn):
        try:
            out[key] = fn()
        except Exception as exc:  # a diagnostic variant may run out of memory; record it, keep going
            out[key] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            reset_peak()

    def d(a, b):
        return {"max_abs_diff": (a - b).abs().max().item(), "top1_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
                "per_request": [round(x, 3) for x in (a - b).abs().amax(-1).tolist()]}  # fmt: skip

    out = {"hf_experts_implementation": str(getattr(hf.config, "_experts_implementation", None)),
           "hf_attn_implementation": str(getattr(hf.config, "_attn_implementation", None))}  # fmt: skip
    ours_b = runner.logits(prompts)
    hf_b = hf_logits(hf, prompts)
    ours_s = torch.cat([runner.logits([p]) for p in prompts])
    hf_s = torch.cat([hf_logits(hf, [p]) for p in prompts])
    out["batched_vs_hf_batched"] = d(ours_b, hf_b)
    out["single_vs_hf_single"] = d(ours_s, hf_s)
    out["cpgraph_batched_vs_single"] = d(ours_b, ours_s)
    out["hf_batched_vs_single"] = d(hf_b, hf_s)
    old = os.environ.get("CPGRAPH_PROVIDERS")
    try:
        for spec in ("indexer_topk:reference", "sparse_mla:reference", "moe_experts:reference", "paged_gather:reference",
                     "reference"):  # fmt: skip
            os.environ["CPGRAPH_PROVIDERS"] = spec
            safe(f"providers={spec}_vs_hf_batched", lambda: d(runner.logits(prompts), hf_b))
    finally:
        if old is None:
            os.environ.pop("CPGRAPH_PROVIDERS", None)
        else:
            os.environ["CPGRAPH_PROVIDERS"] = old
    layout = runner.model.kv_layout
    runner.model.kv_layout = type(layout)(layout.kv_format, layout.page_size, 1 << 31)
    try:
        safe("one_indexer_chunk_vs_hf_batched", lambda: d(runner.logits(prompts), hf_b))
    finally:
        runner.model.kv_layout = layout
    # fp32 on both sides (same weights upcast); cpgraph's Triton providers take bf16, so reference ops.
    def fp32():
        hf32 = copy.deepcopy(hf).float()
        model32 = copy.deepcopy(runner.model).float()
        model32.kv_layout = make_layout(model32, "bf16", runner.page)
        r32 = CpgraphRunner.__new__(CpgraphRunner)
        r32.model, r32.page, r32.pools = model32, runner.page, None
        os.environ["CPGRAPH_PROVIDERS"] = "reference"
        try:
            ours32 = r32.logits(prompts)
        finally:
            if old is None:
                os.environ.pop("CPGRAPH_PROVIDERS", None)
            else:
                os.environ["CPGRAPH_PROVIDERS"] = old
        hf32_b = hf_logits(hf32, prompts)
        del hf32, model32, r32
        out["hf_bf16_vs_hf_fp32"] = d(hf_b, hf32_b)
        out["cpgraph_bf16_vs_cpgraph_fp32"] = d(ours_b, ours32)
        return d(ours32, hf32_b)

    safe("fp32_batched_vs_hf_fp32_batched", fp32)
    reset_peak()
    for k, v in out.items():
        log(f"  diagnose {k}: {json.dumps(v) if isinstance(v, dict) else v}")
    return out


# --------------------------------------------------------------------- main
TARGETS = {"1x2K": 2.0, "1x8K": 10.0, "8x1K": 3.0, "8x32@4K": 5.0}  # x transformers; 1x32K: < 500 ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--modes", default="eager,compiled,graphed,compiled-graphed",
                    help=f"cpgraph modes, comma list of {', '.join(MODES)} (the fastest is reported)")  # fmt: skip
    ap.add_argument("--big-modes", default="eager,compiled",
                    help="modes for cases of 32K tokens or more (capture and compile cost device time there)")
    ap.add_argument("--huge-modes", default="eager", help="modes for cases of 128K tokens")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-hf", action="store_true", help="cpgraph side only")
    ap.add_argument("--profile", default="", help="comma list of cases to profile (top GPU kernels of one forward)")
    ap.add_argument("--diagnose", default="", help="comma list of cases whose logit agreement is dissected")
    ap.add_argument("--json", default=None, help="write the results here (rewritten after every case)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a dry run of every code path at tiny shapes and a tiny config (figures meaningless)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("vs_transformers: needs a CUDA GPU (or --device cpu for a dry run)", file=sys.stderr)
        sys.exit(2)
    split = lambda v: [c.strip() for c in v.split(",") if c.strip()]  # noqa: E731
    names = split(args.cases)
    bad = [n for n in names + split(args.profile) + split(args.diagnose) if n not in CASES]
    modes, big, huge = split(args.modes), split(args.big_modes), split(args.huge_modes)
    bad_modes = [m for m in modes + big + huge if m not in MODES]
    if bad or not modes or bad_modes:
        print(f"vs_transformers: unknown case/mode {bad or bad_modes or modes}; cases: {', '.join(CASES)}; "
              f"modes: {', '.join(MODES)}", file=sys.stderr)  # fmt: skip
        sys.exit(2)

    import transformers
    import triton

    from cpgraph.models import DSAConfig
    from cpgraph.ops.providers import active_provider, bind_providers

    bind_providers("cuda")  # the GPU providers, before anything is timed

    torch._dynamo.config.recompile_limit = max(64, getattr(torch._dynamo.config, "recompile_limit", 8))
    dev_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
    log(f"device {dev_name}; torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}")
    gemm = dense_gemm_tflops()
    log(f"dense bf16 GEMM 8192^3: {gemm:.0f} TFLOP/s")
    hf, model, cfg_dict, why_no_hf = build_models(args.seed, DEVICE, TINY if DEVICE == "cpu" else None)
    if args.no_hf:
        hf, why_no_hf = None, "--no-hf"
    cfg = DSAConfig.from_hf_dict(cfg_dict)
    providers = {op: active_provider(op, DEVICE) for op in ("moe_experts", "sparse_mla", "indexer_topk", "paged_gather")}
    log(f"cpgraph providers on {DEVICE}: {providers}")
    runner = CpgraphRunner(model, args.page, sorted(set(modes + big + huge), key=MODES.index))
    g = torch.Generator().manual_seed(args.seed + 1)
    results = []
    meta = {"device": dev_name, "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "dense_gemm_tflops": gemm, "providers": providers,
            "config": {k: v for k, v in cfg_dict.items() if not isinstance(v, dict)}, "args": vars(args)}  # fmt: skip
    for name in names:
        case = CASES[name]
        if DEVICE == "cpu":
            case = Case(case.name, case.requests, TINY_CASES[name], TINY_PREFIX if case.prefix else 0, case.cpgraph_only)
        L = case.prefix + case.extend
        prompts = [torch.randint(0, cfg.vocab_size, (L,), generator=g).tolist() for _ in range(case.requests)]
        flops = forward_flops(cfg, case.requests, case.extend, case.prefix)
        new_tokens = case.requests * case.extend
        tokens = CASES[name].requests * CASES[name].extend
        case_modes = huge if tokens >= 131072 else big if tokens >= 32768 else modes
        repeat = 1 if tokens >= 131072 else args.repeat
        log(f"case {name}: modes {case_modes}, repeat {repeat}")
        row = {"case": name, "requests": case.requests, "new_tokens": case.extend, "prefix": case.prefix,
               "forward_tflop": flops / 1e12}  # fmt: skip
        try:
            ours, our_logits = runner.run(prompts, case.prefix, repeat, case_modes, profile=name in args.profile)
        except torch.cuda.OutOfMemoryError as exc:
            ours, our_logits = {"error": f"OOM: {str(exc).splitlines()[0]}"}, None
        if "ms" in ours:
            ours["tokens_per_s"] = new_tokens / (ours["ms"] * 1e-3)
            ours["tflops"] = flops / (ours["ms"] * 1e-3) / 1e12
            ours["share_of_dense_gemm"] = ours["tflops"] / gemm
        row["cpgraph"] = ours
        reset_peak()
        if hf is not None and not case.cpgraph_only:
            try:
                theirs, hf_out = run_hf(hf, prompts, case.prefix, args.repeat)
                theirs["tokens_per_s"] = new_tokens / (theirs["ms"] * 1e-3)
                theirs["tflops"] = flops / (theirs["ms"] * 1e-3) / 1e12
                row["transformers"] = theirs
                if our_logits is not None:
                    row["agreement"] = agreement(our_logits, hf_out)
                    row["speedup_vs_transformers"] = theirs["ms"] / ours["ms"]
                del hf_out
            except torch.cuda.OutOfMemoryError as exc:
                row["transformers"] = {"error": f"OOM: {str(exc).splitlines()[0]}"}
        elif hf is None:
            row["transformers"] = {"skipped": why_no_hf}
        reset_peak()
        if hf is not None and name in args.diagnose and not case.prefix:
            row["diagnose"] = diagnose_agreement(hf, runner, prompts)
        results.append(row)
        log(json.dumps({k: v for k, v in row.items() if k != "diagnose"}))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"meta": meta, "cases": results}, indent=2))

    print(f"\nvs_transformers on {dev_name} (dense bf16 GEMM {gemm:.0f} TFLOP/s), kernel-shaped DSA, bf16")
    print(f"{'case':<10}{'cpgraph ms':>11}{'mode':>18}{'tok/s':>11}{'%GEMM':>7}{'GiB':>7}"
          f"{'HF ms':>10}{'HF GiB':>8}{'x HF':>7}{'target':>8}{'max|d|':>9}{'top1':>6}")  # fmt: skip
    for r in results:
        c, t, a = r["cpgraph"], r.get("transformers", {}), r.get("agreement", {})
        if "ms" not in c:
            print(f"{r['case']:<10}  cpgraph {c.get('error')}")
            continue
        hf_ms = f"{t['ms']:.1f}" if "ms" in t else "-"
        hf_gb = f"{t['peak_gib']:.1f}" if "peak_gib" in t else "-"
        sp = f"{r['speedup_vs_transformers']:.2f}" if "speedup_vs_transformers" in r else "-"
        target = f"{TARGETS[r['case']]:.0f}x" if r["case"] in TARGETS else "-"
        d = f"{a['max_abs_diff']:.3f}" if a else "-"
        top1 = f"{a['top1_agree']:.2f}" if a else "-"
        print(f"{r['case']:<10}{c['ms']:>11.2f}{c['best_mode']:>18}{c['tokens_per_s']:>11.0f}"
              f"{100 * c['share_of_dense_gemm']:>6.1f}%{c['peak_gib']:>7.1f}{hf_ms:>10}{hf_gb:>8}{sp:>7}{target:>8}{d:>9}{top1:>6}")  # fmt: skip
    print("\nper mode (ms; first call s; capture s / pool MiB for graphed modes):")
    for r in results:
        for m, v in r["cpgraph"].get("modes", {}).items():
            cap = v.get("capture") or []
            cap_s = f"  capture {cap[0]['capture_s']:.2f} s, warm-up {cap[0]['warmup_s']:.2f} s, pool {cap[0]['pool_mib']:.0f} MiB" if cap else ""
            print(f"  {r['case']:<9}{m:<18}{v['ms']:>10.2f} ms  first {v['first_call_s']:.2f} s  peak {v['peak_gib']:.2f} GiB"
                  f"  d_vs_first {v.get('max_abs_diff_vs_first', 0):.3g}{cap_s}")  # fmt: skip


if __name__ == "__main__":
    main()
