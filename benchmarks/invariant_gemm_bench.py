"""Deterministic mode's GEMM (``cpgraph/kernels/invariant_gemm.py``) against cuBLAS and the hardware, same run.

Deterministic mode trades cuBLAS's per-``M`` kernel choice for one Triton
config per weight shape (docs/deterministic.md).  This measures what that
costs at DeepSeek-V3.2's dense-layer products, ``M`` = 32768 rows by
default: per weight shape, the median ms of ``torch.mm`` (cuBLAS, picks by
``M``) and of ``invariant_gemm.matmul``, their TFLOP/s (``2 M N K``
over the time), ours / cuBLAS, and the share of the same run's best
cuBLAS rate (a ``M x 8192 x 8192`` product: what this H200 reaches).  The
``layer`` line sums one dense layer's products (each shape once).

``--tiles BM,BN,BK,warps,stages ...`` times the Triton kernel at each given
config too (through ``CPGRAPH_INVARIANT_GEMM_TILES``); the best per shape
and the best single config for all shapes are printed, since the mode needs
one config per weight shape, never per ``M``.  Every Triton result is
checked against cuBLAS to bf16 rounding first (``rtol = atol = 2e-2`` on
operands of unit scale) so a wrong config cannot win.  ``--device cpu``
(with ``TRITON_INTERPRET=1``) is a dry run at tiny sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

# (name, N, K): the weight shapes of one V3.2 dense layer (the MoE layer's shared expert is the last two).
SHAPES = [
    ("q_a", 1536, 7168), ("kv_a", 576, 7168), ("q_b", 24576, 1536), ("o_proj", 7168, 16384),
    ("idx_q_b", 8192, 1536), ("mlp_gate_up", 36864, 7168), ("mlp_down", 7168, 18432),
    ("shared_gate_up", 4096, 7168), ("shared_down", 7168, 2048),
    # fp32 products (exact, no TF32, in both modes): the MoE router and the indexer's head weights
    ("router_f32", 256, 7168), ("idx_weights_f32", 64, 7168),
]
TINY = [("a", 96, 80), ("b", 64, 200), ("c_f32", 32, 48)]


def _time_ms(fn, repeat: int, cuda: bool) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            import time

            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--tiles", nargs="*", default=[], help="extra Triton configs BM,BN,BK,warps,stages to time")
    ap.add_argument("--tiles-f32", nargs="*", default=[], help="extra configs for the fp32 shapes")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from cpgraph.kernels.invariant_gemm import TILES_ENV, TILES_F32_ENV, matmul, tiles

    cuda = args.device == "cuda"
    dev = torch.device(args.device)
    shapes = SHAPES if cuda else TINY
    m = args.rows if cuda else 70
    g = torch.Generator(device=dev).manual_seed(0)
    configs_bf16 = [None] + [tuple(int(v) for v in t.split(",")) for t in args.tiles]
    configs_f32 = [None] + [tuple(int(v) for v in t.split(",")) for t in args.tiles_f32]
    configs = list(dict.fromkeys(configs_bf16 + configs_f32))
    if cuda:
        sq = torch.randn(m, 8192, device=dev, dtype=torch.bfloat16, generator=g)
        peak_ms = _time_ms(lambda: sq @ sq[:8192].t(), args.repeat, cuda)
        peak = 2 * m * 8192 * 8192 / peak_ms / 1e9
        del sq
    else:
        peak = float("nan")
    rows, totals = [], {"cublas": 0.0, **{str(c): 0.0 for c in configs}}
    for name, n, k in shapes:
        dtype = torch.float32 if name.endswith("_f32") else torch.bfloat16
        env, mine = (TILES_F32_ENV, configs_f32) if dtype == torch.float32 else (TILES_ENV, configs_bf16)
        x = torch.randn(m, k, device=dev, dtype=dtype, generator=g)
        w = torch.randn(n, k, device=dev, dtype=dtype, generator=g) * k ** -0.5
        flop = 2 * m * n * k
        want = x @ w.t()
        row = {"name": name, "N": n, "K": k, "default_tiles": list(tiles(n, k, dtype)),
               "cublas_ms": _time_ms(lambda: x @ w.t(), args.repeat, cuda)}
        row["cublas_tflops"] = flop / row["cublas_ms"] / 1e9
        totals["cublas"] += row["cublas_ms"]
        for cfg in configs:
            if cfg not in mine:
                row[f"ms {cfg}"] = 0.0 if cfg is None else float("nan")
                continue
            if cfg is not None:
                os.environ[env] = ",".join(map(str, cfg))
            try:
                got = matmul(x, w.t())
                torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
                ms = _time_ms(lambda: matmul(x, w.t()), args.repeat, cuda)
            except Exception as e:  # a config the GPU cannot run (shared memory) is reported, not fatal
                ms, row[f"error {cfg}"] = float("inf"), f"{type(e).__name__}: {str(e)[:120]}"
            finally:
                os.environ.pop(env, None)
            row[f"ms {cfg}"] = ms
            totals[str(cfg)] += ms
        best = min(mine, key=lambda c: row[f"ms {c}"])
        row["best"] = list(best) if best else "default"
        row["ours_ms"] = row["ms None"]
        row["ours_tflops"] = flop / row["ours_ms"] / 1e9
        row["ours_over_cublas"] = row["ours_ms"] / row["cublas_ms"]
        row["share_of_peak"] = row["ours_tflops"] / peak
        rows.append(row)
        print(f"{name:15s} N={n:6d} K={k:6d}: cuBLAS {row['cublas_ms']:7.3f} ms {row['cublas_tflops']:6.1f} TFLOP/s | "
              f"ours {row['ours_ms']:7.3f} ms {row['ours_tflops']:6.1f} TFLOP/s ({row['ours_over_cublas']:.2f}x "
              f"cuBLAS time, {row['share_of_peak']:.2f} of peak) | best config {row['best']} "
              f"{row[f'ms {best}']:.3f} ms", flush=True)
        del x, w, want
    # Per dtype, the best single config over that dtype's shapes (a config not timed there counts as default).
    best_all = {}
    for label, mine, pick in (("bf16", configs_bf16, lambda r: not r["name"].endswith("_f32")),
                              ("fp32", configs_f32, lambda r: r["name"].endswith("_f32"))):
        sel = [r for r in rows if pick(r)]
        if sel:
            best = min(mine, key=lambda c: sum(r[f"ms {c}"] for r in sel))
            best_all[label] = (best, sum(r[f"ms {best}"] for r in sel), sum(r["ms None"] for r in sel),
                               sum(r["cublas_ms"] for r in sel))
    for label, (best, ms, default_ms, cublas_ms) in best_all.items():
        print(f"{label} shapes: cuBLAS {cublas_ms:.2f} ms; ours (default tiles) {default_ms:.2f} ms "
              f"({default_ms / cublas_ms:.2f}x); best single config {best or 'default'} {ms:.2f} ms "
              f"({ms / cublas_ms:.2f}x)", flush=True)
    print(f"layer (each shape once): cuBLAS {totals['cublas']:.2f} ms, ours {totals['None']:.2f} ms "
          f"({totals['None'] / totals['cublas']:.2f}x); peak cuBLAS {peak:.0f} TFLOP/s", flush=True)
    report = {"rows_m": m, "peak_cublas_tflops": peak, "shapes": rows, "totals_ms": totals,
              "best_single_config": {k: (list(v[0]) if v[0] else "default") for k, v in best_all.items()}}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    main()
