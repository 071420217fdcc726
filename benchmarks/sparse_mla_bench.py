"""Sparse MLA prefill on one GPU: cpgraph's Triton kernel against FlashMLA, a dense GEMM and the torch reference.

Shapes: ``M`` query rows over ``N = M`` keys of one causal prefill (row ``s``
is position ``s``), top-k 2048, D 576, d_v 512, ``H`` = 64 and 128 heads.
Row ``s`` lists ``min(s + 1, 2048)`` keys of ``[0, s]`` (spread over the
whole prefix once the prefix is longer than the top-k, ``-1`` after the
keys of a short row).  The "short" shape has ``M = 2K``: every row holds
at most top-k keys, all selected.

Per shape and implementation one table row:

* ``ms`` median time (CUDA events), ``TFLOP/s`` with FLOPs = 2 * H * (576 +
  512) per valid listed key;
* ``x flash``: FlashMLA's time / this time, same run (FlashMLA's SM90 kernel
  called bare; ``provider`` is cpgraph's FlashMLA provider with its id
  conversion and lse fix, so its ``x flash`` is the provider overhead);
* ``%gemm``: this rate / the rate of a dense bf16 GEMM of the same FLOPs
  (``[8192, k] @ [k, 8192]``), same run;
* ``x ref``: speed-up over the torch reference.  The reference is timed on
  its last ``--ref-rows`` rows (full top-k rows) and scaled per FLOP:
  running it on every row of a 32K prefill takes seconds per shape.

``fp8`` rows read 656-byte FP8 records (``cpgraph::sparse_mla_fp8``), their
``x bf16`` column is the ratio to the Triton bf16 kernel.

    python benchmarks/sparse_mla_bench.py --json out.json            # 4K and 32K rows, short rows
    python benchmarks/sparse_mla_bench.py --rows 4096,32768,131072   # add 128K
    python benchmarks/sparse_mla_bench.py --sweep                    # time tile variants, print registers/spills
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import sys
import time

import torch

TOPK = 2048
D = 576
DV = 512
SM_SCALE = 192**-0.5

# Tile variants for --sweep: (head block, BLOCK_N, warps, stages).  Measured on the H200
# (docs/ops/sparse_mla.md): BLOCK_N 64 / 8 warps / 2 stages is the fastest for both key formats.
SWEEP = [(64, 64, 8, 2), (64, 32, 8, 2), (64, 32, 8, 3), (64, 64, 16, 2), (64, 64, 8, 1)]
SWEEP_FP8 = [(64, 64, 8, 2), (64, 32, 8, 2), (64, 64, 16, 2)]


def _cfg(t):
    return {"head_block": t[0], "block_n": t[1], "num_warps": t[2], "num_stages": t[3]}


def make_case(M: int, H: int, seed: int = 0):
    """``q, kv, idx`` of a causal prefill of ``M`` rows (keys = the rows themselves)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(M, H, D, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    kv = torch.randn(M, D, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.empty(M, TOPK, dtype=torch.int32, device="cuda")
    j = torch.arange(TOPK, device="cuda")[None, :]
    for a in range(0, M, 8192):  # bounded temporaries at 128K rows
        pos = torch.arange(a, min(M, a + 8192), device="cuda")[:, None]
        u = torch.rand(pos.shape[0], TOPK, device="cuda", generator=g)
        spread = ((j + u) * (pos + 1) / TOPK).long()
        idx[a : a + pos.shape[0]] = torch.where(pos + 1 <= TOPK, torch.where(j <= pos, j, -1), spread).to(torch.int32)
    return q, kv, idx


def valid_keys(idx: torch.Tensor, n: int) -> int:
    return int(((idx >= 0) & (idx < n)).sum().item())  # sync-ok: benchmark bookkeeping


def time_ms(fn, budget_ms: float = 400.0, min_reps: int = 3, max_reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    torch.cuda.synchronize()
    first = start.elapsed_time(stop)
    reps = int(min(max_reps, max(min_reps, budget_ms // max(first, 1e-3))))
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def gemm_tflops(flops: float) -> float:
    """Rate of a dense bf16 ``[8192, k] @ [k, 8192]`` GEMM with (about) ``flops`` FLOPs."""
    k = max(256, int(flops / (2 * 8192 * 8192)) // 256 * 256)
    k = min(k, 262144)  # bounded memory; the rate is flat beyond that
    a = torch.randn(8192, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, 8192, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b)
    del a, b
    return 2 * 8192 * 8192 * k / ms / 1e9


def _precompile(args):
    """Worker: compile one tile variant (the Triton cache on disk is shared with the parent)."""
    cfg, H, fp8 = args
    import cpgraph.ops  # noqa: F401
    from cpgraph.kernels import sparse_mla as ks

    q, kv, idx = make_case(64, H)
    kv = torch.cat([kv, kv, kv, kv] * 16)  # N = 4096 keys: same integer specialisation as the real runs
    try:
        if fp8:
            rec = torch.ops.cpgraph.mla_fp8_pack(kv[:, :512].float(), kv[:, 512:])
            ks.sparse_mla_fp8(q, rec, idx, SM_SCALE, DV, config=_cfg(cfg))
        else:
            ks.sparse_mla(q, kv, idx, SM_SCALE, DV, config=_cfg(cfg))
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # noqa: BLE001
        return f"{cfg} H={H} fp8={fp8}: {type(exc).__name__}: {str(exc)[:300]}"


def precompile(jobs, workers: int) -> None:
    t0 = time.time()
    with mp.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
        for err in pool.imap_unordered(_precompile, jobs):
            if err:
                print(f"  compile failed: {err}", flush=True)
    print(f"precompiled {len(jobs)} variants in {time.time() - t0:.1f} s", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rows", default="4096,32768", help="comma-separated M (keys N = M)")
    ap.add_argument("--heads", default="64,128")
    ap.add_argument("--short-rows", type=int, default=2048, help="M of the all-keys-selected shape (0: skip)")
    ap.add_argument("--ref-rows", type=int, default=256, help="rows the reference is timed on (0: skip)")
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="time the tile variants instead of the default tile")
    ap.add_argument("--workers", type=int, default=12, help="parallel compile processes (0: compile on first use)")
    ap.add_argument("--json", default=None, help="write the results here too")
    ap.add_argument("--precompile-only", action="store_true", help="compile the variants (Triton disk cache) and exit")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sparse_mla_bench: needs a CUDA device", file=sys.stderr)
        return 2

    import cpgraph.ops  # noqa: F401
    from cpgraph.kernels import flash_mla as kflash
    from cpgraph.kernels import sparse_mla as ks
    from cpgraph.ops.sparse_mla import sparse_mla_reference

    heads = [int(h) for h in args.heads.split(",") if h]
    shapes = [(int(m), h, False) for m in args.rows.split(",") if m for h in heads]
    if args.short_rows:
        shapes += [(args.short_rows, h, True) for h in heads]
    variants = [(_cfg(c), c) for c in SWEEP] if args.sweep else [(None, "default")]
    fp8_variants = [] if args.no_fp8 else ([(_cfg(c), c) for c in SWEEP_FP8] if args.sweep else [(None, "default")])
    has_flash = kflash.load()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  FlashMLA: "
          f"{'yes' if has_flash else kflash.import_error()}", flush=True)  # fmt: skip

    jobs = [(c, h, False) for c in (SWEEP if args.sweep else [tuple(ks._default_tile(False))]) for h in heads]
    jobs += [(c, h, True) for c in (SWEEP_FP8 if args.sweep else [tuple(ks._default_tile(True))]) for h in heads]
    if args.no_fp8:
        jobs = [j for j in jobs if not j[2]]
    if args.workers > 0:
        precompile(jobs, args.workers)
    if args.precompile_only:
        return 0

    results = []
    header = f"{'shape':>22} {'impl':>22} {'ms':>9} {'TFLOP/s':>8} {'x flash':>8} {'%gemm':>6} {'x ref':>8} {'x bf16':>7}"
    print(header, flush=True)
    for M, H, short in shapes:
        q, kv, idx = make_case(M, H)  # short shape: M <= top-k, every row lists all its keys
        n_valid = valid_keys(idx, kv.shape[0])
        flops = 2.0 * H * (D + DV) * n_valid
        gemm = gemm_tflops(flops)
        label = f"M={M // 1024}K H={H}" + (" short" if short else "")
        rows = {}

        def add(impl, ms, **extra):
            rate = flops / ms / 1e9
            rows[impl] = ms
            rec = {"M": M, "H": H, "short": short, "impl": impl, "ms": ms, "tflops": rate, "gemm_tflops": gemm,
                   "pct_gemm": 100 * rate / gemm, **extra}  # fmt: skip
            if "flash" in rows and impl != "flash":
                rec["x_flash"] = rows["flash"] / ms
            results.append(rec)
            xf = f"{rec['x_flash']:.3f}" if "x_flash" in rec else "-"
            xr = f"{rec['x_ref']:.1f}" if "x_ref" in rec else "-"
            xb = f"{rec['x_bf16']:.3f}" if "x_bf16" in rec else "-"
            print(f"{label:>22} {impl:>22} {ms:9.3f} {rate:8.1f} {xf:>8} {rec['pct_gemm']:6.1f} {xr:>8} {xb:>7}",
                  flush=True)  # fmt: skip

        if has_flash and not kflash.refusal(q, kv, idx, DV):
            ids = idx.unsqueeze(1)
            kv3 = kv.unsqueeze(1)
            add("flash", time_ms(lambda: kflash._flash.flash_mla_sparse_fwd(q, kv3, ids, SM_SCALE, DV, use_legacy=True)))
            add("provider(flash)", time_ms(lambda: kflash.sparse_mla(q, kv, idx, SM_SCALE, DV)))
        ref_x = None
        if args.ref_rows:
            r = min(args.ref_rows, M)
            qs, ids = q[M - r :], idx[M - r :]
            ref_ms = time_ms(lambda: sparse_mla_reference(qs, kv, ids, SM_SCALE, DV), budget_ms=1500, min_reps=1)
            ref_flops = 2.0 * H * (D + DV) * valid_keys(ids, kv.shape[0])
            ref_x = ref_ms / ref_flops  # ms per FLOP, scaled to the whole shape below
        best_bf16 = None
        for cfg, name in variants:
            try:
                ms = time_ms(lambda: ks.sparse_mla(q, kv, idx, SM_SCALE, DV, config=cfg))
            except Exception as exc:  # noqa: BLE001
                print(f"{label:>22} triton{name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            extra = {"tile": str(name)}
            if ref_x is not None:
                extra["x_ref"] = ref_x * flops / ms
            add(f"triton{'' if cfg is None else name}", ms, **extra)
            best_bf16 = ms if best_bf16 is None else min(best_bf16, ms)
        if fp8_variants:
            rec = torch.ops.cpgraph.mla_fp8_pack(kv[:, :512].float(), kv[:, 512:])
            for cfg, name in fp8_variants:
                try:
                    ms = time_ms(lambda: ks.sparse_mla_fp8(q, rec, idx, SM_SCALE, DV, config=cfg))
                except Exception as exc:  # noqa: BLE001
                    print(f"{label:>22} fp8{name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                extra = {"tile": str(name)}
                if best_bf16:
                    extra["x_bf16"] = best_bf16 / ms
                add(f"fp8{'' if cfg is None else name}", ms, **extra)
            del rec
        del q, kv, idx
        torch.cuda.empty_cache()

    meta = ks.kernel_metadata()
    print("\ncompiled variants (registers per thread, spills, shared memory bytes):")
    for m in meta:
        print(f"  fp8={m['kv_fp8']!s:5} hb={m['head_block']} block_n={m['block_n']} warps={m['num_warps']} "
              f"stages={m['num_stages']}: regs={m['n_regs']} spills={m['n_spills']} smem={m['shared_bytes']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
                       "results": results, "kernels": meta}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
