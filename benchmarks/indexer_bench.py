"""Lightning indexer on one GPU: cpgraph's Triton scoring + tie-rule top-k against a dense GEMM and the torch reference.

Shapes (64 heads x 128, top-k 2048, page 64, bf16): one request of 8K, 32K
and 128K tokens; 8 requests of 4K; an extend of 8 x 32 tokens over an 8K
cached prefix.  Keys are the ragged full view (page-tail slack included,
never inside a window); row ``s`` of a request at position ``p`` scores the
``p + 1`` keys of its causal window.

Per shape one table row:

* ``ms``: ``cpgraph::indexer_topk``'s Triton provider, median (CUDA events),
  with the op's byte budget for one chunk of fp32 scores (``--budget``,
  default 64 MiB as in the model);
* ``score ms`` / ``TFLOP/s``: the scoring kernel alone over the same chunks,
  FLOPs = 2 * H * D per in-window key;
* ``%gemm``: that rate over a dense bf16 ``torch.matmul`` of the same FLOPs
  (square, side ``cbrt(F / 2)`` clamped to [2048, 16384], repeated to reach
  F), same run; ``fp8`` rows use FP8 e4m3 scoring against ``torch._scaled_mm``;
* ``sel %``: (``ms`` - ``score ms``) / ``ms``: the selection kernels' share
  of the fused op (plus its launches);
* ``x ref``: the torch reference's time / ``ms``.  The reference scores
  every column of every row, so its cost follows ``rows x N``; it is run
  where ``rows x N <= --ref-max-tokens**2`` (default 32K) and otherwise
  *estimated* from the largest measured shape scaled by ``rows x N``, and
  marked ``~``.

With ``--fp8`` each shape also gets an ``fp8`` row: the FP8 form of
``indexer_topk`` (``k_scale`` given: e4m3 operands of Hadamard-rotated q/k,
ue8m0 scales) timed the same way, its scoring against ``torch._scaled_mm``.
``--deep-gemm`` adds ``fp8-dg`` rows: DeepGEMM's mqa-logits kernel scoring
the same chunks (``cpgraph.kernels.deep_gemm_indexer``), selected by the
Triton selection; skipped with the import error when it does not load.
``--profile SHAPE`` records the top kernels (``torch.profiler``) of one
fused call per format at that shape.

``--sweep`` first times scoring variants (bf16 and FP8 apart) and
selection variants at 32K (selection on one chunk of rows from the middle
of the request; ``topk_select_bench.py`` times whole layers), applies the fastest,
and with ``--tuning-out`` saves it as a ``CPGRAPH_INDEXER_TUNING`` file.

    python benchmarks/indexer_bench.py --json out.json
    python benchmarks/indexer_bench.py --sweep --tuning-out tune.json --fp8 --json out.json
    PYTHONPATH=/path/to/deep_gemm python benchmarks/indexer_bench.py --fp8 --deep-gemm --profile 32k
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

import gpu_state

H, D, TOPK, PAGE = 64, 128, 2048, 64
SHAPES = {
    "8k": ([8192], [0]),
    "32k": ([32768], [0]),
    "128k": ([131072], [0]),
    "8x4k": ([4096] * 8, [0] * 8),
    "ext8x32": ([32] * 8, [8192] * 8),
}
# --sweep variants at 32K.  Scoring: (MMA rows, key tile, warps, stages, keys on the M axis, FP8 group, maxnreg).
SCORE_SWEEP = [(128, 128, 8, 2, False, 0, 0), (128, 128, 8, 2, True, 0, 0), (128, 128, 8, 2, True, 0, 128),
               (128, 64, 4, 3, True, 0, 0), (256, 128, 8, 2, True, 0, 0),
               # around the default (128, 64, 4, 3): deeper and shallower pipelines, twice the key or row tile,
               # two warpgroups on one tile, one row a program
               (128, 64, 4, 4, True, 0, 0), (128, 64, 4, 2, True, 0, 0), (128, 128, 4, 3, True, 0, 0),
               (256, 64, 4, 3, True, 0, 0), (256, 64, 8, 3, True, 0, 0), (128, 64, 8, 3, True, 0, 0),
               (64, 64, 4, 3, True, 0, 0), (128, 32, 4, 4, True, 0, 0)]
FP8_SWEEP = [(128, 128, 8, 2, False, 32, 0), (128, 128, 8, 2, True, 0, 0), (128, 128, 8, 2, True, 0, 128),
             (128, 64, 4, 3, True, 0, 0), (256, 128, 8, 2, True, 0, 0), (128, 64, 4, 3, True, 32, 0),
             # four query rows a program, as the bf16 default since 2026-12-05 (not yet timed for FP8 keys)
             (256, 64, 4, 3, True, 0, 0), (256, 64, 4, 4, True, 0, 0), (256, 64, 8, 3, True, 0, 0)]
# Selection: (block, warps, sample, maxnreg).
SELECT_SWEEP = [(512, 4, 512, 0), (1024, 4, 512, 0), (512, 4, 1024, 0), (256, 4, 512, 0), (512, 8, 512, 0)]


def _fail(msg: str) -> None:
    print(f"indexer_bench: {msg}", file=sys.stderr)
    sys.exit(2)


def make_case(lens, prefix, fp8=False, seed=0):
    """(q, k, w, ks, ke, in-window keys) of a batch of causal requests over a page-padded ragged view."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ks, ke, start = [], [], 0
    for n, p in zip(lens, prefix):
        pos = torch.arange(p, p + n, device="cuda")
        ks.append(torch.full((n,), start, device="cuda", dtype=torch.int32))
        ke.append((start + pos + 1).to(torch.int32))
        start += -(-(p + n) // PAGE) * PAGE  # page-tail slack stays in the view, outside every window
    ks, ke = torch.cat(ks), torch.cat(ke)
    M, N = ks.shape[0], start
    q = torch.randn(M, H, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(N, D, device="cuda", generator=g).bfloat16()
    w = torch.randn(M, H, device="cuda", generator=g) * (H**-0.5 * D**-0.5)
    keys = sum(p * n + n * (n + 1) // 2 for n, p in zip(lens, prefix))
    return q, k, w, ks, ke, keys


def fp8_case(q, k, w):
    """The production FP8 operands of a bf16 case: Hadamard-rotated q/k as e4m3 bytes, ue8m0 scales."""
    from cpgraph.ops import indexer as ix

    q_bytes, w_q = ix.indexer_q_quant_reference(ix.hadamard_reference(q), w)
    kh = ix.hadamard_reference(k)
    k_scale = ix.ue8m0_scale(kh.float().abs().amax(-1))
    return q_bytes, ix.e4m3_bytes(kh, k_scale), k_scale, w_q


def time_ms(fn, budget_ms=600.0, max_reps=20):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    first = a.elapsed_time(b)
    reps = max(1, min(max_reps, int(budget_ms / max(first, 1e-3))))
    times = []
    for _ in range(reps):
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def once_ms(fn):
    """One timed call (the reference takes seconds at 32K; it launches no kernels that need compiling)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def dense_rate(flops, fp8=False):
    """TFLOP/s of a dense square GEMM run to the same FLOPs (bf16 matmul or FP8 _scaled_mm)."""
    side = int(round(min(16384, max(2048, (flops / 2) ** (1 / 3))) / 256)) * 256
    reps = max(1, round(flops / (2 * side**3)))
    a = torch.randn(side, side, device="cuda").to(torch.bfloat16)
    b = torch.randn(side, side, device="cuda").to(torch.bfloat16)
    if fp8:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device="cuda")

        def fn():
            for _ in range(reps):
                torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    else:
        def fn():
            for _ in range(reps):
                torch.matmul(a, b)
    ms = time_ms(fn, budget_ms=300.0)
    return 2 * side**3 * reps / (ms * 1e-3) / 1e12


def chunks(M, N, budget):
    from cpgraph.ops.indexer import logits_chunk_rows

    rows = min(M, logits_chunk_rows(N, budget))
    return rows, [(a, min(rows, M - a)) for a in range(0, M, rows)]


def run_shape(name, budget, ref_max_tokens, fp8, fp8_max_tokens, deep_gemm):
    from cpgraph.kernels import indexer as ki
    from cpgraph.ops import indexer as ix

    lens, prefix = SHAPES[name]
    q, k, w, ks, ke, keys = make_case(lens, prefix)
    M, N = q.shape[0], k.shape[0]
    flops = 2 * H * D * keys
    rows, parts = chunks(M, N, budget)
    buf = torch.empty((rows, N), dtype=torch.float32, device="cuda")

    def scoring(qq=q, kk=k, ww=w, scale=None):
        for a, m in parts:
            ki.score_rows(qq, kk, ww, ks, ke, buf, a, m, k_scale=scale)

    base = {"shape": name, "rows": M, "keys_in_window": keys, "N": N, "budget_bytes": budget, "chunk_rows": rows}
    row = {**base, "format": "bf16", "tuning": ki.tuning()}
    row["ms"] = time_ms(lambda: ki.indexer_topk(q, k, w, ks, ke, TOPK, budget))
    row["score_ms"] = time_ms(scoring)
    dense = dense_rate(flops)
    finish(row, flops, dense)
    if M * N <= ref_max_tokens**2:  # the reference scores every column: its cost follows M * N
        row["ref_ms"] = once_ms(lambda: ix.indexer_topk_reference(q, k, w, ks, ke, TOPK, budget))
        row["ref_estimated"] = False
    out_rows = [row]
    if fp8 and sum(lens) + sum(prefix) <= fp8_max_tokens:
        q_bytes, k_bytes, k_scale, w_q = fp8_case(q, k, w)
        del q
        f8 = torch.float8_e4m3fn
        dense8 = dense_rate(flops, fp8=True)
        frow = {**base, "format": "fp8"}
        frow["ms"] = time_ms(lambda: ki.indexer_topk(q_bytes, k_bytes, w_q, ks, ke, TOPK, budget, k_scale))
        frow["score_ms"] = time_ms(lambda: scoring(q_bytes.view(f8), k_bytes.view(f8), w_q, k_scale))
        finish(frow, flops, dense8)
        if M * N <= ref_max_tokens**2:
            frow["ref_ms"] = once_ms(lambda: ix.indexer_topk_reference(q_bytes, k_bytes, w_q, ks, ke, TOPK, budget,
                                                                        k_scale))
            frow["ref_estimated"] = False
        out_rows.append(frow)
        if deep_gemm:
            from cpgraph.kernels import deep_gemm_indexer as dg

            drow = {**base, "format": "fp8-dg", "kernel": dg.kernel_name()}
            try:
                drow["ms"] = time_ms(lambda: dg.indexer_topk(q_bytes, k_bytes, w_q, ks, ke, TOPK, budget, k_scale))
                drow["score_ms"] = time_ms(lambda: [dg._logits(q_bytes[a:a + m], k_bytes, k_scale, w_q[a:a + m],
                                                               ks[a:a + m], ke[a:a + m]) for a, m in parts])
                finish(drow, flops, dense8)
                if M * N <= ref_max_tokens**2:
                    drow["ref_ms"], drow["ref_estimated"] = frow["ref_ms"], False
                out_rows.append(drow)
            except Exception as exc:  # noqa: BLE001 - a failing optional provider is reported, not fatal
                print(f"{name}: deep_gemm failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    del buf, k
    torch.cuda.empty_cache()
    return out_rows


def finish(row, flops, dense):
    """Rates and shares of one row: scoring TFLOP/s, share of the dense GEMM, selection share of the op."""
    row["select_ms"] = max(0.0, row["ms"] - row["score_ms"])  # the rest of the fused op: selection + launches
    row["tflops"] = flops / (row["score_ms"] * 1e-3) / 1e12
    row["dense_tflops"] = dense
    row["pct_gemm"] = 100 * row["tflops"] / dense
    row["select_pct"] = 100 * row["select_ms"] / row["ms"]


def profile(name, budget, fp8, deep_gemm):
    """Top CUDA kernels of one fused call per format at ``name`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from cpgraph.kernels import indexer as ki

    lens, prefix = SHAPES[name]
    q, k, w, ks, ke, _ = make_case(lens, prefix)
    calls = {"bf16": lambda: ki.indexer_topk(q, k, w, ks, ke, TOPK, budget)}
    if fp8:
        q_bytes, k_bytes, k_scale, w_q = fp8_case(q, k, w)
        calls["fp8"] = lambda: ki.indexer_topk(q_bytes, k_bytes, w_q, ks, ke, TOPK, budget, k_scale)
        if deep_gemm:
            from cpgraph.kernels import deep_gemm_indexer as dg

            calls["fp8-dg"] = lambda: dg.indexer_topk(q_bytes, k_bytes, w_q, ks, ke, TOPK, budget, k_scale)
    report = {}
    for fmt, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        events.sort(key=lambda e: e.device_time_total, reverse=True)
        total = sum(e.device_time_total for e in events)
        top = [{"kernel": e.key[:90], "ms": e.device_time_total / 1e3, "calls": e.count,
                "share": e.device_time_total / max(total, 1e-9)} for e in events[:8]]
        report[fmt] = {"total_ms": total / 1e3, "top": top}
        print(f"profile {name} {fmt}: {total / 1e3:.2f} ms of kernels", flush=True)
        for t in top:
            print(f"  {t['ms']:9.3f} ms {100 * t['share']:5.1f} % x{t['calls']:<4} {t['kernel']}", flush=True)
    del q, k
    torch.cuda.empty_cache()
    return report


def sweep(budget, fp8, out_path=None):
    """Time scoring (bf16 and FP8 apart) and selection variants at 32K; apply (and optionally save) the fastest."""
    from cpgraph.kernels import indexer as ki

    lens, prefix = SHAPES["32k"]
    q, k, w, ks, ke, keys = make_case(lens, prefix)
    M, N = q.shape[0], k.shape[0]
    rows, parts = chunks(M, N, budget)
    buf = torch.empty((rows, N), dtype=torch.float32, device="cuda")
    flops = 2 * H * D * keys
    best = {}
    # Each variant's clocks: the scoring alone is compared with the same kernel inside the forward
    # (production_shape.py --replay), where the SM clock may be held lower (benchmarks/gpu_state.py).
    gpu = gpu_state.GpuState.start(torch.cuda.current_device())
    if not gpu.available:
        print(f"GPU state not sampled: {gpu.why}", flush=True)
    results = {"score": [], "score_fp8": [], "select": []}
    formats = [("bf16", SCORE_SWEEP, q, k, w, None, "")]
    if fp8:
        q_bytes, k_bytes, k_scale, w_q = fp8_case(q, k, w)
        f8 = torch.float8_e4m3fn
        formats.append(("fp8", FP8_SWEEP, q_bytes.view(f8), k_bytes.view(f8), w_q, k_scale, "FP8_"))
    for fmt, variants, qq, kk, ww, scale, pre in formats:
        fast = None
        for mma_rows, tile, warps, stages, keys_m, group, maxnreg in variants:
            v = (mma_rows, tile, warps, stages, keys_m, group, maxnreg)
            kw = dict(rows_per_block=mma_rows // H, key_tile=tile, num_warps=warps, num_stages=stages, keys_m=keys_m,
                      fp8_group=group, maxnreg=maxnreg)
            try:
                t0 = gpu.now()
                ms = time_ms(lambda: [ki.score_rows(qq, kk, ww, ks, ke, buf, a, m, k_scale=scale, **kw)
                                      for a, m in parts], budget_ms=250.0)
                clocks = gpu.window(t0, gpu.now())
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
                print(f"score {fmt} {v}: failed: {str(exc)[:200]}", flush=True)
                continue
            tf = flops / (ms * 1e-3) / 1e12
            results["score" if fmt == "bf16" else "score_fp8"].append({"variant": list(v), "ms": ms, "tflops": tf,
                                                                       "gpu": clocks})  # fmt: skip
            shown = f"; {gpu_state.describe(clocks)}" if gpu.available else ""
            print(f"score {fmt} {v}: {ms:.3f} ms, {tf:.1f} TFLOP/s{shown}", flush=True)
            if fast is None or ms < fast[0]:
                fast = (ms, v)
        if fast is not None:
            mma_rows, tile, warps, stages, keys_m, group, maxnreg = fast[1]
            best.update({pre + "MMA_ROWS": mma_rows, pre + "KEY_TILE": tile, pre + "SCORE_WARPS": warps,
                         pre + "SCORE_STAGES": stages, pre + "KEYS_M": keys_m, pre + "SCORE_MAXNREG": maxnreg})
            if fmt == "fp8":
                best["FP8_ACC_GROUP"] = group
    # Selection on one chunk from the middle of the request (its scores really written).
    a = (M // 2 // rows) * rows
    m = min(rows, M - a)
    ki.score_rows(q, k, w, ks, ke, buf, a, m)
    out = torch.empty((M, TOPK), dtype=torch.int32, device="cuda")
    scratch = torch.empty((rows, ki.scratch_columns(N, TOPK)), dtype=torch.int32, device="cuda")
    sel_best = None
    for v in SELECT_SWEEP:
        block, warps, sample, maxnreg = v

        def fn():
            ki.select_rows(buf, ks, ke, out, a, m, TOPK, scratch=scratch, block=block, num_warps=warps,
                           sample=sample, maxnreg=maxnreg)
        try:
            ms = time_ms(fn, budget_ms=150.0)
        except Exception as exc:  # noqa: BLE001
            print(f"select {v}: failed: {str(exc)[:200]}", flush=True)
            continue
        results["select"].append({"variant": list(v), "chunk_rows": m, "ms": ms})
        print(f"select {v}: {ms:.3f} ms per {m} rows", flush=True)
        if sel_best is None or ms < sel_best[0]:
            sel_best = (ms, v)
    if sel_best is not None:
        block, warps, sample, maxnreg = sel_best[1]
        best.update(SELECT_BLOCK=block, SELECT_WARPS=warps, SELECT_SAMPLE=sample, SELECT_MAXNREG=maxnreg)
    ki.set_tuning(**best)
    print(f"best: {best}", flush=True)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(best, f)
    gpu.stop()
    del buf, scratch, out, q, k
    torch.cuda.empty_cache()
    return results, best


def fill_estimates(rows):
    measured = [r for r in rows if r.get("ref_ms") is not None and not r.get("ref_estimated")]
    for r in rows:
        same = [m for m in measured if m["format"] == r["format"]]
        if r.get("ref_ms") is None and same:
            base = max(same, key=lambda m: m["rows"] * m["N"])
            r["ref_ms"] = base["ref_ms"] * (r["rows"] * r["N"]) / (base["rows"] * base["N"])
            r["ref_estimated"] = True
        if r.get("ref_ms") is not None:
            r["x_ref"] = r["ref_ms"] / r["ms"]


def print_table(rows):
    head = f"{'shape':>8} {'fmt':>6} {'rows':>7} {'ms':>9} {'score ms':>9} {'TFLOP/s':>8} {'%gemm':>6} {'sel %':>6} {'x ref':>8}"
    print(head)
    for r in rows:
        xr = r.get("x_ref")
        xs = "-" if xr is None else ("~" if r.get("ref_estimated") else "") + f"{xr:.1f}"
        ms = f"{r['ms']:9.3f}" if "ms" in r else f"{'-':>9}"
        sel = f"{r['select_pct']:6.1f}" if "select_pct" in r else f"{'-':>6}"
        print(f"{r['shape']:>8} {r['format']:>6} {r['rows']:>7} {ms} {r['score_ms']:>9.3f} "
              f"{r['tflops']:>8.1f} {r['pct_gemm']:>6.1f} {sel} {xs:>8}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8k,32k,128k,8x4k,ext8x32", help="'' with --sweep: the sweep alone")
    p.add_argument("--budget", type=int, default=64 << 20, help="max_logits_bytes (one chunk of fp32 scores)")
    p.add_argument("--ref-max-tokens", type=int, default=32768)
    p.add_argument("--fp8", action="store_true", help="also time the FP8 form (scoring against torch._scaled_mm)")
    p.add_argument("--fp8-max-tokens", type=int, default=131072, help="FP8 rows only for shapes up to this many keys")
    p.add_argument("--deep-gemm", action="store_true", help="with --fp8: also time DeepGEMM's mqa-logits scoring")
    p.add_argument("--profile", default=None, help="shape whose fused calls are profiled (top kernels)")
    p.add_argument("--sweep", action="store_true", help="first time tile variants at 32K and use the fastest")
    p.add_argument("--tuning-out", default=None, help="with --sweep: write the fastest variant as a tuning file")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        _fail("needs a CUDA device")
    names = [s.strip() for s in a.shapes.split(",") if s.strip()]
    bad = [s for s in names if s not in SHAPES]
    if bad:
        _fail(f"unknown shape(s) {bad}; choose from {sorted(SHAPES)}")
    import cpgraph.ops  # noqa: F401

    deep_gemm = None
    if a.deep_gemm:
        from cpgraph.kernels import deep_gemm_indexer as dg

        deep_gemm = {"loaded": dg.load(), "kernel": dg.kernel_name(), "error": dg.import_error()}
        print(f"deep_gemm: {deep_gemm}", flush=True)
    use_dg = bool(deep_gemm and deep_gemm["loaded"])
    swept = sweep(a.budget, a.fp8, a.tuning_out) if a.sweep else None
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
            "heads": H, "head_dim": D, "topk": TOPK, "page": PAGE}

    def save(rows, prof=None):
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"meta": meta, "sweep": swept, "rows": rows, "deep_gemm": deep_gemm, "profile": prof}, f,
                          indent=1)

    rows = []
    for name in names:
        rows.extend(run_shape(name, a.budget, a.ref_max_tokens, a.fp8, a.fp8_max_tokens, use_dg))
        print(f"{name} done", flush=True)
        save(rows)  # a run cut short keeps the shapes it finished
    fill_estimates(rows)
    prof = profile(a.profile, a.budget, a.fp8, use_dg) if a.profile else None
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, budget {a.budget >> 20} MiB")
    print_table(rows)
    save(rows, prof)
    return rows


if __name__ == "__main__":
    main()
