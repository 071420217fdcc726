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

``--sweep`` first times scoring and selection variants at 32K (selection on
one chunk of rows from the middle of the request, with and without the
final sort), applies the fastest, and with ``--tuning-out`` saves it as a
``CPGRAPH_INDEXER_TUNING`` file.

    python benchmarks/indexer_bench.py --json out.json
    python benchmarks/indexer_bench.py --sweep --tuning-out tune.json --fp8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

H, D, TOPK, PAGE = 64, 128, 2048, 64
SHAPES = {
    "8k": ([8192], [0]),
    "32k": ([32768], [0]),
    "128k": ([131072], [0]),
    "8x4k": ([4096] * 8, [0] * 8),
    "ext8x32": ([32] * 8, [8192] * 8),
}
# --sweep variants at 32K.  Scoring: (MMA rows, key tile, warps, stages, keys on the M axis).
SCORE_SWEEP = [(128, 128, 8, 2, False), (128, 128, 8, 2, True), (256, 128, 8, 2, True), (128, 128, 4, 2, True),
               (256, 64, 8, 2, True), (128, 64, 4, 3, False)]
# Selection: (block, warps, compact).
SELECT_SWEEP = [(4096, 8, True), (4096, 8, False), (2048, 4, True), (8192, 8, True), (2048, 8, True), (1024, 4, True)]


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


def run_shape(name, budget, ref_max_tokens, fp8):
    from cpgraph.kernels import indexer as ki
    from cpgraph.ops import indexer as ix

    lens, prefix = SHAPES[name]
    q, k, w, ks, ke, keys = make_case(lens, prefix)
    M, N = q.shape[0], k.shape[0]
    flops = 2 * H * D * keys
    rows, parts = chunks(M, N, budget)
    buf = torch.empty((rows, N), dtype=torch.float32, device="cuda")

    def scoring(qq=q, kk=k, scale=None):
        for a, m in parts:
            ki.score_rows(qq, kk, w, ks, ke, buf, a, m, k_scale=scale)

    row = {"shape": name, "rows": M, "keys_in_window": keys, "N": N, "budget_bytes": budget, "chunk_rows": rows,
           "format": "bf16", "tuning": ki.tuning()}
    row["ms"] = time_ms(lambda: ki.indexer_topk(q, k, w, ks, ke, TOPK, budget))
    row["score_ms"] = time_ms(scoring)
    row["select_ms"] = max(0.0, row["ms"] - row["score_ms"])  # the rest of the fused op: selection + launches
    row["tflops"] = flops / (row["score_ms"] * 1e-3) / 1e12
    row["dense_tflops"] = dense_rate(flops)
    row["pct_gemm"] = 100 * row["tflops"] / row["dense_tflops"]
    row["select_pct"] = 100 * row["select_ms"] / row["ms"]
    if M * N <= ref_max_tokens**2:  # the reference scores every column: its cost follows M * N
        row["ref_ms"] = once_ms(lambda: ix.indexer_topk_reference(q, k, w, ks, ke, TOPK, budget))
        row["ref_estimated"] = False
    out_rows = [row]
    if fp8 and sum(lens) + sum(prefix) <= 32768:
        qh, kh = ix.hadamard_reference(q), ix.hadamard_reference(k)
        q_bytes, _ = ix.indexer_q_quant_reference(qh, w)
        k_scale = ix.ue8m0_scale(kh.float().abs().amax(-1))
        k_bytes = ix.e4m3_bytes(kh, k_scale)
        del qh, kh
        f8 = torch.float8_e4m3fn
        frow = {key: row[key] for key in ("shape", "rows", "keys_in_window", "N", "budget_bytes", "chunk_rows")}
        frow["format"] = "fp8"
        frow["score_ms"] = time_ms(lambda: scoring(q_bytes.view(f8), k_bytes.view(f8), k_scale))
        frow["tflops"] = flops / (frow["score_ms"] * 1e-3) / 1e12
        frow["dense_tflops"] = dense_rate(flops, fp8=True)
        frow["pct_gemm"] = 100 * frow["tflops"] / frow["dense_tflops"]
        out_rows.append(frow)
    del buf, q, k
    torch.cuda.empty_cache()
    return out_rows


def sweep(budget, out_path=None):
    """Time scoring and selection variants at 32K; apply (and optionally save) the fastest."""
    from cpgraph.kernels import indexer as ki

    lens, prefix = SHAPES["32k"]
    q, k, w, ks, ke, keys = make_case(lens, prefix)
    M, N = q.shape[0], k.shape[0]
    rows, parts = chunks(M, N, budget)
    buf = torch.empty((rows, N), dtype=torch.float32, device="cuda")
    flops = 2 * H * D * keys
    best = {}
    results = {"score": [], "select": []}
    for mma_rows, tile, warps, stages, keys_m in SCORE_SWEEP:
        kw = dict(rows_per_block=mma_rows // H, key_tile=tile, num_warps=warps, num_stages=stages, keys_m=keys_m)
        try:
            ms = time_ms(lambda: [ki.score_rows(q, k, w, ks, ke, buf, a, m, **kw) for a, m in parts], budget_ms=250.0)
        except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
            print(f"score {mma_rows, tile, warps, stages, keys_m}: failed: {str(exc)[:200]}", flush=True)
            continue
        tf = flops / (ms * 1e-3) / 1e12
        results["score"].append({"variant": [mma_rows, tile, warps, stages, keys_m], "ms": ms, "tflops": tf})
        print(f"score {mma_rows, tile, warps, stages, keys_m}: {ms:.3f} ms, {tf:.1f} TFLOP/s", flush=True)
        if "score_ms" not in best or ms < best["score_ms"]:
            best.update(score_ms=ms, MMA_ROWS=mma_rows, KEY_TILE=tile, SCORE_WARPS=warps, SCORE_STAGES=stages,
                        KEYS_M=keys_m)
    # Selection on one chunk from the middle of the request (its scores really written).
    a = (M // 2 // rows) * rows
    m = min(rows, M - a)
    ki.score_rows(q, k, w, ks, ke, buf, a, m)
    out = torch.empty((M, TOPK), dtype=torch.int32, device="cuda")
    scratch = torch.empty((rows, N), dtype=torch.int32, device="cuda")
    for block, warps, compact in SELECT_SWEEP:
        for sort in (True, False) if (block, warps, compact) == SELECT_SWEEP[0] else (True,):
            def fn():
                ki.select_rows(buf, ks, ke, out, a, m, TOPK, scratch=scratch, block=block, num_warps=warps,
                               compact=compact, sort=sort)
            try:
                ms = time_ms(fn, budget_ms=150.0)
            except Exception as exc:  # noqa: BLE001
                print(f"select {block, warps, compact}: failed: {str(exc)[:200]}", flush=True)
                continue
            results["select"].append({"variant": [block, warps, compact, sort], "chunk_rows": m, "ms": ms})
            print(f"select {block, warps, compact} sort={sort}: {ms:.3f} ms per {m} rows", flush=True)
            if sort and ("select_ms" not in best or ms < best["select_ms"]):
                best.update(select_ms=ms, SELECT_BLOCK=block, SELECT_WARPS=warps, SELECT_COMPACT=compact)
    tune = {key: v for key, v in best.items() if key.isupper()}
    ki.set_tuning(**tune)
    print(f"best: {tune}", flush=True)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(tune, f)
    del buf, scratch, out, q, k
    torch.cuda.empty_cache()
    return results, tune


def fill_estimates(rows):
    measured = [r for r in rows if r.get("ref_ms") is not None and not r.get("ref_estimated")]
    for r in rows:
        if r.get("ref_ms") is None and r["format"] == "bf16" and measured:
            base = max(measured, key=lambda m: m["rows"] * m["N"])
            r["ref_ms"] = base["ref_ms"] * (r["rows"] * r["N"]) / (base["rows"] * base["N"])
            r["ref_estimated"] = True
        if r.get("ref_ms") is not None:
            r["x_ref"] = r["ref_ms"] / r["ms"]


def print_table(rows):
    head = f"{'shape':>8} {'fmt':>4} {'rows':>7} {'ms':>9} {'score ms':>9} {'TFLOP/s':>8} {'%gemm':>6} {'sel %':>6} {'x ref':>8}"
    print(head)
    for r in rows:
        xr = r.get("x_ref")
        xs = "-" if xr is None else ("~" if r.get("ref_estimated") else "") + f"{xr:.1f}"
        ms = f"{r['ms']:9.3f}" if "ms" in r else f"{'-':>9}"
        sel = f"{r['select_pct']:6.1f}" if "select_pct" in r else f"{'-':>6}"
        print(f"{r['shape']:>8} {r['format']:>4} {r['rows']:>7} {ms} {r['score_ms']:>9.3f} "
              f"{r['tflops']:>8.1f} {r['pct_gemm']:>6.1f} {sel} {xs:>8}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8k,32k,128k,8x4k,ext8x32")
    p.add_argument("--budget", type=int, default=64 << 20, help="max_logits_bytes (one chunk of fp32 scores)")
    p.add_argument("--ref-max-tokens", type=int, default=32768)
    p.add_argument("--fp8", action="store_true", help="also time FP8 e4m3 scoring against torch._scaled_mm (<= 32K)")
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

    swept = sweep(a.budget, a.tuning_out) if a.sweep else None
    rows = []
    for name in names:
        rows.extend(run_shape(name, a.budget, a.ref_max_tokens, a.fp8))
        print(f"{name} done", flush=True)
    fill_estimates(rows)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, budget {a.budget >> 20} MiB")
    print_table(rows)
    if a.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
                "heads": H, "head_dim": D, "topk": TOPK, "page": PAGE}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "sweep": swept, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
