"""DeepGEMM's SM90 GEMMs against cpgraph's own FP8 kernels and the bf16 peers, at DeepSeek-V3.2's shapes.

Why: with DeepGEMM installed, cpgraph runs its m-grouped FP8 GEMM for the routed experts
(``cpgraph/kernels/deep_gemm_experts.py``) and its dense FP8 GEMM for the projections
(``CPGRAPH_FP8_LINEAR=auto``); this script measures, in one run, what that buys over the code that
runs without it, and against the bf16 GEMMs the FP8 targets are stated against:

* ``grouped``: 32K tokens x top-8 over 256 experts (uniform routing), gate/up (N 4096, K 7168) and
  down (N 7168, K 2048): the Triton grouped FP8 GEMM (``kernels/fp8_grouped.grouped_gemm``),
  DeepGEMM's ``m_grouped_fp8_gemm_nt_contiguous`` on the padded layout, the gather into that
  layout, ``torch._grouped_mm`` bf16 (CUTLASS) and DeepGEMM's bf16 grouped GEMM; DeepGEMM's
  outputs are compared with the Triton GEMM's, checked for host syncs and replayed from a CUDA graph;
* ``dense``: V3.2 projections at ``--tokens`` rows: cuBLASLt's blockwise FP8 GEMM (``F.scaled_mm``),
  DeepGEMM's ``fp8_gemm_nt`` (column-major and row-major activation scales), bf16 ``torch.matmul``
  and the activation quantisation;
* ``indexer``: FP8 indexer logits over one 32K causal request in 1 GiB chunks, the Triton scoring
  kernel against DeepGEMM's ``fp8_fp4_mqa_logits``.

Times are medians of ``triton.testing.do_bench``; TFLOP/s count 2 per multiply-add.

    CUDA_HOME=/usr/local/cuda python benchmarks/deep_gemm_bench.py --json deep_gemm.json
    python benchmarks/deep_gemm_bench.py --sections dense --tokens 4096
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

TOPK, E, H, I = 8, 256, 7168, 2048
DENSE = [("q_a", 1536, 7168), ("q_b", 24576, 1536), ("o_proj", 7168, 16384), ("mlp_gate_up", 36864, 7168),
         ("mlp_down", 7168, 18432), ("shared_gate_up", 4096, 7168), ("shared_down", 7168, 2048),
         ("indexer_wq_b", 8192, 1536)]


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=200, return_mode="median")


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def fp8_weights(e, n, k):
    """e4m3 ``[e, n, k]`` drawn in slices (no fp32 copy of the whole stack) and 128 x 128 block scales."""
    w = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device="cuda")
    for j in range(0, e, 16):
        w[j:j + 16] = (torch.randn(min(16, e - j), n, k, device="cuda", dtype=torch.bfloat16) * 0.5).to(w.dtype)
    return w, torch.rand(e, n // 128, k // 128, device="cuda") * 0.01 + 0.005


def grouped(dg, tokens: int) -> dict:
    from cpgraph.kernels import deep_gemm_experts as dge
    from cpgraph.kernels.fp8_grouped import grouped_gemm, swiglu_quantize
    from cpgraph.kernels.fp8_linear import quantize_activations
    from cpgraph.kernels.move import take_rows
    from cpgraph.ops.moe import dispatch_plan

    c = tokens * TOPK
    ids = torch.rand(tokens, E, device="cuda").topk(TOPK, dim=1).indices.to(torch.int32)
    plan = dispatch_plan(ids, None, E)
    src = plan.order // TOPK
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    xq, xs = quantize_activations(x, 128, False)
    w1, w1s = fp8_weights(E, 2 * I, H)
    w2, w2s = fp8_weights(E, H, I)
    r: dict = {}
    r["ours_gate_up_ms"] = bench(lambda: grouped_gemm(xq, xs, src, w1, w1s, plan.group_ends, 128, 128, torch.bfloat16, c))
    h = grouped_gemm(xq, xs, src, w1, w1s, plan.group_ends, 128, 128, torch.bfloat16, c)
    aq, a_s = swiglu_quantize(h, plan.group_ends, 128, False)
    r["ours_down_ms"] = bench(lambda: grouped_gemm(aq, a_s, None, w2, w2s, plan.group_ends, 128, 128, torch.bfloat16, c))
    y = grouped_gemm(aq, a_s, None, w2, w2s, plan.group_ends, 128, 128, torch.bfloat16, c)

    pos, psum, p = dge.padded_layout(plan.group_ends, c)
    token = dge._inverse(pos, src, p)
    sorted_row = dge._inverse(pos, torch.arange(c, device="cuda"), p)
    r["gather_ms"] = bench(lambda: (take_rows(xq, token), take_rows(xs, token)))
    a, sa = take_rows(xq, token), take_rows(xs, token)
    d1 = torch.empty(p, 2 * I, device="cuda", dtype=torch.bfloat16)
    t0 = time.time()
    gate_up = lambda: dg.m_grouped_fp8_gemm_nt_contiguous((a, sa), (w1, w1s), d1, psum, use_psum_layout=True)  # noqa: E731
    gate_up()
    torch.cuda.synchronize()
    r["deep_gemm_first_call_s"] = time.time() - t0  # includes the JIT compile of a new configuration
    r["deep_gemm_gate_up_ms"] = bench(gate_up)
    r["deep_gemm_gate_up_rel_vs_ours"] = rel(d1[pos], h)
    aq_p, as_p = take_rows(aq, sorted_row), take_rows(a_s, sorted_row)
    d2 = torch.empty(p, H, device="cuda", dtype=torch.bfloat16)
    down = lambda: dg.m_grouped_fp8_gemm_nt_contiguous((aq_p, as_p), (w2, w2s), d2, psum, use_psum_layout=True)  # noqa: E731
    down()
    r["deep_gemm_down_ms"] = bench(down)
    r["deep_gemm_down_rel_vs_ours"] = rel(d2[pos], y)
    torch.cuda.set_sync_debug_mode("error")
    try:
        gate_up()
        r["deep_gemm_host_sync_free"] = True
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = d1[pos].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gate_up()
    d1.zero_()
    graph.replay()
    torch.cuda.synchronize()
    r["deep_gemm_graph_replay_equal"] = bool(torch.equal(d1[pos], want))

    xb = x.index_select(0, src)
    w1b = torch.empty(E, 2 * I, H, device="cuda", dtype=torch.bfloat16)
    for j in range(0, E, 16):
        w1b[j:j + 16] = w1[j:j + 16].to(torch.bfloat16)
    r["bf16_gate_up_ms"] = bench(lambda: torch._grouped_mm(xb, w1b.transpose(1, 2), offs=plan.group_ends))
    xb_p = take_rows(x, token)
    db = torch.empty(p, 2 * I, device="cuda", dtype=torch.bfloat16)
    r["deep_gemm_bf16_gate_up_ms"] = bench(
        lambda: dg.m_grouped_bf16_gemm_nt_contiguous(xb_p, w1b, db, psum, use_psum_layout=True))
    del w1b, xb, xb_p, db
    w2b = w2.to(torch.bfloat16)
    ab = h[:, :I].contiguous()
    r["bf16_down_ms"] = bench(lambda: torch._grouped_mm(ab, w2b.transpose(1, 2), offs=plan.group_ends))
    ab_p = take_rows(ab, sorted_row)
    db2 = torch.empty(p, H, device="cuda", dtype=torch.bfloat16)
    r["deep_gemm_bf16_down_ms"] = bench(
        lambda: dg.m_grouped_bf16_gemm_nt_contiguous(ab_p, w2b, db2, psum, use_psum_layout=True))
    flops = {"gate_up": 2 * c * H * 2 * I, "down": 2 * c * I * H}
    for key in [k for k in r if k.endswith("_ms") and ("gate_up" in k or "down" in k)]:
        r[key[:-3] + "_tflops"] = flops["gate_up" if "gate_up" in key else "down"] / r[key] / 1e9
    bf16 = r["bf16_gate_up_ms"] + r["bf16_down_ms"]
    r["deep_gemm_fp8_x_bf16"] = bf16 / (r["deep_gemm_gate_up_ms"] + r["deep_gemm_down_ms"])
    r["deep_gemm_fp8_with_gather_x_bf16"] = bf16 / (r["deep_gemm_gate_up_ms"] + r["deep_gemm_down_ms"] + r["gather_ms"])
    r["ours_fp8_x_bf16"] = bf16 / (r["ours_gate_up_ms"] + r["ours_down_ms"])
    return r


def dense(dg, tokens: int) -> dict:
    from cpgraph.kernels.fp8_linear import quantize_activations, scaled_mm_gemm

    out = {}
    for name, n, k in DENSE:
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        w, ws = fp8_weights(1, n, k)
        w, ws = w[0], ws[0]
        xq, xs = quantize_activations(x, 128, False, scales_column_major=True)
        xq_r, xs_r = quantize_activations(x, 128, False)
        d = torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16)
        wb = w.to(torch.bfloat16)
        row = {"cublaslt_ms": bench(lambda: scaled_mm_gemm(xq, xs, w, ws, torch.bfloat16)),
               "deep_gemm_ms": bench(lambda: dg.fp8_gemm_nt((xq, xs), (w, ws), d)),
               "deep_gemm_row_major_scales_ms": bench(lambda: dg.fp8_gemm_nt((xq_r, xs_r), (w, ws), d)),
               "bf16_ms": bench(lambda: x @ wb.t()),
               "quantize_ms": bench(lambda: quantize_activations(x, 128, False, scales_column_major=True))}
        dg.fp8_gemm_nt((xq, xs), (w, ws), d)
        row["deep_gemm_rel_vs_cublaslt"] = rel(d, scaled_mm_gemm(xq, xs, w, ws, torch.bfloat16))
        flops = 2 * tokens * n * k
        for key in [k for k in row if k.endswith("_ms") and k != "quantize_ms"]:
            row[key[:-3] + "_tflops"] = flops / row[key] / 1e9
        row["deep_gemm_x_bf16_with_quant"] = row["bf16_ms"] / (row["deep_gemm_ms"] + row["quantize_ms"])
        row["cublaslt_x_bf16_with_quant"] = row["bf16_ms"] / (row["cublaslt_ms"] + row["quantize_ms"])
        out[name] = row
        print(f"  {name:15s} N {n:5d} K {k:5d}: DeepGEMM {row['deep_gemm_ms']:.3f} ms, cuBLASLt {row['cublaslt_ms']:.3f}, "
              f"bf16 {row['bf16_ms']:.3f}, quant {row['quantize_ms']:.3f}; with quant x bf16: DeepGEMM "
              f"{row['deep_gemm_x_bf16_with_quant']:.2f}, cuBLASLt {row['cublaslt_x_bf16_with_quant']:.2f}", flush=True)
        del x, w, wb, d
    return out


def indexer(dg) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import indexer_bench as ib

    from cpgraph.kernels import indexer as ki

    f8 = torch.float8_e4m3fn
    lens, prefix = ib.SHAPES["32k"]
    q, k, w, ks, ke, keys = ib.make_case(lens, prefix)
    qb, kb, ksc, wq = ib.fp8_case(q, k, w)
    m, n = q.shape[0], k.shape[0]
    rows = (1 << 30) // (4 * n)
    parts = [(a, min(rows, m - a)) for a in range(0, m, rows)]
    buf = torch.empty((rows, n), dtype=torch.float32, device="cuda")
    ks32, ke32 = ks.int().contiguous(), ke.int().contiguous()
    qf, kf, kscale = qb.view(f8).contiguous(), kb.view(f8).contiguous(), ksc.float().contiguous()

    def ours():
        for a, rr in parts:
            ki.score_rows(qb.view(f8), kb.view(f8), wq, ks, ke, buf, a, rr, k_scale=ksc)

    def theirs():
        return [dg.fp8_fp4_mqa_logits((qf[a:a + rr], None), (kf, kscale), wq[a:a + rr].contiguous(), ks32[a:a + rr],
                                      ke32[a:a + rr], n) for a, rr in parts]

    r = {"ours_ms": bench(ours), "deep_gemm_ms": bench(theirs)}
    flops = 2 * 64 * 128 * keys
    r["ours_tflops"], r["deep_gemm_tflops"] = flops / r["ours_ms"] / 1e9, flops / r["deep_gemm_ms"] / 1e9
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="grouped,dense,indexer", help="comma list of grouped, dense, indexer")
    ap.add_argument("--tokens", type=int, default=32768, help="tokens (grouped: routed rows = 8x this)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if bad := [s for s in sections if s not in ("grouped", "dense", "indexer")]:
        ap.error(f"unknown sections {bad}: choose from grouped, dense, indexer")
    if not torch.cuda.is_available():
        print("deep_gemm_bench: needs a CUDA GPU (SM90) with deep_gemm installed", file=sys.stderr)
        return 2
    from cpgraph.kernels import deep_gemm_experts as dge

    dg = dge.load()
    if dg is None:
        print(f"deep_gemm_bench: deep_gemm does not load: {dge.import_error()}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "deep_gemm": getattr(dg, "__version__", "?"),
              "torch": torch.__version__, "tokens": args.tokens}
    for section in sections:
        print(f"{section}:", flush=True)
        report[section] = {"grouped": lambda: grouped(dg, args.tokens), "dense": lambda: dense(dg, args.tokens),
                           "indexer": lambda: indexer(dg)}[section]()
        torch.cuda.empty_cache()
        if section != "dense":
            print(json.dumps(report[section], indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
