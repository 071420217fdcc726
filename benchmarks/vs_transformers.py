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
run.  The cpgraph side reports eager and ``cpgraph.compile`` (Inductor, CP size 1) and takes the
better of the two.

Reading the agreement: with random weights the indexer's scores are nearly tied, so once a
query's window is longer than ``index_topk`` (2048) bf16 rounding alone changes which keys are
selected and the logits move by O(1) on both sides of any correct implementation; the exact
fp32 top-k comparison is the CPU oracle test.  Where every window fits in the top-k (``1x2K``,
``8x1K``) the two sides should agree to bf16 noise.

Needs only torch, triton and transformers (>= 5.13: ``DeepseekV32ForCausalLM``)::

    python benchmarks/vs_transformers.py [--cases 1x2K,8x1K] [--modes eager,compiled] [--json out.json]
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


def time_ms(fn, repeat: int, setup=None, warmup: int = 2) -> float:
    """Median ms of ``fn()`` between CUDA events; ``setup()`` runs untimed before each call."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        samples.append(a.elapsed_time(b))
    return statistics.median(samples)


def dense_gemm_tflops(n: int = 8192, repeat: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, repeat, warmup=3)
    del a, b
    return 2 * n**3 / (ms * 1e-3) / 1e12


def forward_flops(cfg, requests: int, extend: int, prefix: int) -> float:
    """Useful FLOPs of one extend forward (multiply-add = 2), the work a sparse prefill must do.

    Per token and layer: the projections (MLA q/kv/absorb/W_UV/o, indexer q/k/weights), the
    indexer logits over the causal window, sparse MLA over ``min(topk, window)`` keys at
    ``2 * H * (kv_lora + rope + kv_lora)`` per key, the dense MLP or the routed top-k experts
    plus shared experts and router; plus one lm_head row per request.
    """
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    ql, kl, r = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    ih, idim = cfg.index_n_heads, cfg.index_head_dim
    windows = torch.arange(prefix + 1, prefix + extend + 1, dtype=torch.float64)
    sum_window = float(windows.sum()) * requests
    sum_sel = float(windows.clamp(max=cfg.index_topk).sum()) * requests
    T = requests * extend
    proj = 2 * (H * ql + ql * nh * (nope + r) + H * (kl + r) + nh * nope * kl + nh * kl * v + nh * v * H)
    total = 0.0
    for i in range(cfg.num_hidden_layers):
        total += T * proj + sum_sel * 2 * nh * (kl + r + kl)
        if cfg.indexer_types[i] == "full":
            total += T * 2 * (ql * ih * idim + H * idim + H * ih) + sum_window * 2 * ih * idim
        if cfg.mlp_layer_types[i] == "sparse":
            I = cfg.moe_intermediate_size
            experts = cfg.num_experts_per_tok + cfg.n_shared_experts
            total += T * (2 * H * cfg.n_routed_experts + experts * 6 * H * I)
        else:
            total += T * 6 * H * cfg.intermediate_size
    return total + requests * 2 * H * cfg.vocab_size


def agreement(ours: torch.Tensor, theirs: torch.Tensor) -> dict:
    ours, theirs = ours.float(), theirs.float()
    return {
        "max_abs_diff": (ours - theirs).abs().max().item(),
        "logit_scale": theirs.abs().max().item(),
        "top1_agree": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
    }


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30


def reset_peak() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


# ------------------------------------------------------------------- models
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
    hf = hf.to(torch.bfloat16).eval()
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
class CpgraphRunner:
    def __init__(self, model, page: int, modes: list[str]):
        from cpgraph.models.prefill import make_layout

        self.model = model
        self.page = page
        model.kv_layout = make_layout(model, "bf16", page)
        self.compiled = None
        if "compiled" in modes:
            from cpgraph.passes import CPConfig, compile

            self.compiled = compile(model, CPConfig())
        self.modes = modes

    @torch.no_grad()
    def run(self, prompts, prefix: int, repeat: int) -> dict:
        from cpgraph.models import build_batch
        from cpgraph.plan import plan_prefill
        from cpgraph.runtime.engine import pool_config, pool_tensors
        from cpgraph.runtime.kv_pool import KVPool

        model, ps = self.model, self.page
        B = len(prompts)
        E = len(prompts[0]) - prefix
        pages = [math.ceil(len(p) / ps) for p in prompts]
        reset_peak()
        pool = KVPool(pool_config(model, "bf16", ps, sum(pages)))
        tables = [pool.alloc_pages_with_owners([0] * n) for n in pages]
        mla, index = pool_tensors(pool, model)
        for t in mla + index:
            torch._dynamo.mark_static_address(t)
        dev = model.device
        if prefix:  # fill the cache one request at a time (not timed)
            for i in range(B):
                pre = plan_prefill([0], [prefix], cp_size=1, page_size=ps)
                ids, meta = build_batch(pre, [prompts[i][:prefix]], [tables[i][: prefix // ps]], dev,
                                        prefix_page_owners=[[]])  # fmt: skip
                model(ids, meta, mla, index)
        plan = plan_prefill([prefix] * B, [E] * B, cp_size=1, page_size=ps)
        ids, meta = build_batch(plan, [p[prefix:] for p in prompts], tables, dev)
        out = {}
        fns = {"eager": lambda: model(ids, meta, mla, index).logits}
        if self.compiled is not None:
            fns["compiled"] = lambda: self.compiled(ids, meta, mla, index).logits
        logits = None
        for mode in self.modes:
            fn = fns[mode]
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            got = fn().float()
            first_s = time.perf_counter() - t0
            ms = time_ms(fn, repeat)
            out[mode] = {"ms": ms, "first_call_s": first_s, "peak_gib": peak_gib()}
            if logits is None:
                logits = got
            else:
                out[mode]["max_abs_diff_vs_eager"] = (got - logits).abs().max().item()
        best = min(out, key=lambda m: out[m]["ms"])
        del pool, mla, index
        return {"modes": out, "best_mode": best, "ms": out[best]["ms"], "peak_gib": out[best]["peak_gib"]}, logits


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

    torch.cuda.reset_peak_memory_stats()
    if setup is not None:
        setup()
    logits = fn().float()
    ms = time_ms(fn, repeat, setup=setup, warmup=1)
    return {"ms": ms, "peak_gib": peak_gib()}, logits


# --------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--modes", default="eager,compiled", help="cpgraph modes: eager, compiled (best one is reported)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-hf", action="store_true", help="cpgraph side only")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("vs_transformers: needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [n for n in names if n not in CASES]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad or not modes or any(m not in ("eager", "compiled") for m in modes):
        print(f"vs_transformers: unknown case/mode {bad or modes}; cases: {', '.join(CASES)}", file=sys.stderr)
        sys.exit(2)

    import transformers
    import triton

    import cpgraph.kernels  # noqa: F401  (GPU providers)
    from cpgraph.models import DSAConfig
    from cpgraph.ops.providers import active_provider

    dev_name = torch.cuda.get_device_name()
    log(f"device {dev_name}; torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}")
    gemm = dense_gemm_tflops()
    log(f"dense bf16 GEMM 8192^3: {gemm:.0f} TFLOP/s")
    hf, model, cfg_dict, why_no_hf = build_models(args.seed)
    if args.no_hf:
        hf, why_no_hf = None, "--no-hf"
    cfg = DSAConfig.from_hf_dict(cfg_dict)
    providers = {op: active_provider(op, "cuda") for op in ("moe_experts", "sparse_mla", "indexer_topk", "paged_gather")}
    log(f"cpgraph providers on cuda: {providers}")
    runner = CpgraphRunner(model, args.page, modes)
    g = torch.Generator().manual_seed(args.seed + 1)
    results = []
    for name in names:
        case = CASES[name]
        L = case.prefix + case.extend
        prompts = [torch.randint(0, cfg.vocab_size, (L,), generator=g).tolist() for _ in range(case.requests)]
        flops = forward_flops(cfg, case.requests, case.extend, case.prefix)
        new_tokens = case.requests * case.extend
        row = {"case": name, "requests": case.requests, "new_tokens": case.extend, "prefix": case.prefix,
               "forward_tflop": flops / 1e12}  # fmt: skip
        try:
            ours, our_logits = runner.run(prompts, case.prefix, args.repeat)
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
                theirs, hf_logits = run_hf(hf, prompts, case.prefix, args.repeat)
                theirs["tokens_per_s"] = new_tokens / (theirs["ms"] * 1e-3)
                theirs["tflops"] = flops / (theirs["ms"] * 1e-3) / 1e12
                row["transformers"] = theirs
                if our_logits is not None:
                    row["agreement"] = agreement(our_logits, hf_logits)
                    row["speedup_vs_transformers"] = theirs["ms"] / ours["ms"]
            except torch.cuda.OutOfMemoryError as exc:
                row["transformers"] = {"error": f"OOM: {str(exc).splitlines()[0]}"}
        elif hf is None:
            row["transformers"] = {"skipped": why_no_hf}
        reset_peak()
        results.append(row)
        log(json.dumps(row))

    print(f"\nvs_transformers on {dev_name} (dense bf16 GEMM {gemm:.0f} TFLOP/s), kernel-shaped DSA, bf16")
    print(f"{'case':<10}{'cpgraph ms':>11}{'mode':>10}{'tok/s':>11}{'%GEMM':>7}{'GiB':>7}"
          f"{'HF ms':>10}{'HF GiB':>8}{'x HF':>7}{'max|d|':>9}{'top1':>6}")  # fmt: skip
    for r in results:
        c, t, a = r["cpgraph"], r.get("transformers", {}), r.get("agreement", {})
        if "ms" not in c:
            print(f"{r['case']:<10}  cpgraph {c.get('error')}")
            continue
        hf_ms = f"{t['ms']:.1f}" if "ms" in t else "-"
        hf_gb = f"{t['peak_gib']:.1f}" if "peak_gib" in t else "-"
        sp = f"{r['speedup_vs_transformers']:.2f}" if "speedup_vs_transformers" in r else "-"
        d = f"{a['max_abs_diff']:.3f}" if a else "-"
        top1 = f"{a['top1_agree']:.2f}" if a else "-"
        print(f"{r['case']:<10}{c['ms']:>11.2f}{r['cpgraph']['best_mode']:>10}{c['tokens_per_s']:>11.0f}"
              f"{100 * c['share_of_dense_gemm']:>6.1f}%{c['peak_gib']:>7.1f}{hf_ms:>10}{hf_gb:>8}{sp:>7}{d:>9}{top1:>6}")  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        meta = {"device": dev_name, "torch": torch.__version__, "triton": triton.__version__,
                "transformers": transformers.__version__, "dense_gemm_tflops": gemm, "providers": providers,
                "config": {k: v for k, v in cfg_dict.items() if not isinstance(v, dict)}, "args": vars(args)}  # fmt: skip
        Path(args.json).write_text(json.dumps({"meta": meta, "cases": results}, indent=2))


if __name__ == "__main__":
    main()
