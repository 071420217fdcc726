"""Block-scaled FP8 projections on one GPU at DeepSeek-V3.2 shapes: ``cpgraph::fp8_block_linear`` vs bf16.

Shapes ``(name, N, K)`` are V3.2's FP8 projections (hidden 7168, q_lora 1536,
kv_lora 512 + rope 64, 128 heads, expert intermediate 2048): ``q_a``
7168->1536, ``kv_a`` 7168->576, ``q_a_kv_a`` (both as one GEMM) 7168->2112, ``q_b`` 1536->24576, ``o_proj``
16384->7168, ``wq_b`` (indexer) 1536->8192, ``expert gate_up``
7168->4096, ``expert down`` 2048->7168; ``M`` (tokens) from 256 to 32K.

Per shape, ``M`` and implementation one row:

* ``ms`` median time (CUDA events; quantisation of the activations included),
  ``TFLOP/s`` with FLOPs = ``2 * M * N * K``;
* ``x bf16``: the bf16 GEMM's time / this time (``x @ w.T`` with a bf16
  ``w``, cuBLAS), same run -- above 1 means FP8 is faster;
* ``quant ms``: the activation quantisation kernel alone;
* ``gemm ms`` / ``gemm x bf16``: the GEMM alone on already quantised
  activations (the profile of where the time goes: ``ms ~ quant + gemm``).

Implementations: ``triton`` (cpgraph's Triton GEMM), ``scaled_mm`` (torch's
blockwise-scaled FP8 GEMM where the build and shape allow it), ``deep_gemm``
(DeepGEMM's ``fp8_gemm_nt`` where it is installed: what ``auto`` runs there),
``bf16``.
``--check`` compares each result with the torch reference on the first 256
rows first.

    python benchmarks/fp8_linear_bench.py --json out.json
    python benchmarks/fp8_linear_bench.py --rows 256,4096 --shapes q_a,o_proj --sweep   # Triton tile variants
    python benchmarks/fp8_linear_bench.py --rows 4096,32768 --graph     # CUDA-graph replays (no host time)

Then, per group of projections that read one input (``--groups``): the bf16 GEMMs, FP8 with a quantisation
per projection, and FP8 with one shared quantisation (what the compiled forward runs after the
``share_activation_quantization`` pass), with their ratios to bf16.  Groups whose input a norm produces in the
forward are also timed with that norm (and its residual add) in front: bf16 after Inductor's add + norm kernel,
FP8 quantised after that kernel, and FP8 quantised inside the norm (``fp8_rms_norm_quantize``, what the forward
runs after ``fuse_norm_into_quantization``), with their ratios to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

SHAPES = {
    "q_a": (1536, 7168),
    "kv_a": (576, 7168),
    "q_a_kv_a": (1536 + 576, 7168),  # q_a and kv_a as one GEMM over one quantisation of the normed input
    "q_b": (128 * 192, 1536),
    "o_proj": (7168, 128 * 128),
    "wq_b": (64 * 128, 1536),
    "expert_gate_up": (2 * 2048, 7168),
    "expert_down": (7168, 2048),
}
# Projections that read one activation (cpgraph's share_activation_quantization pass quantises it once for all):
# name -> (K, [(projection, N), ...]).  V3.2: the normed hidden state feeds q_a, kv_a and the indexer's wk; the
# query latent q_b and the indexer's wq_b; a shared expert's input its gate and up (a dense MLP's: N 18432).
GROUPS = {
    "attn_input": (7168, [("q_a", 1536), ("kv_a", 576), ("wk", 128)]),
    "q_latent": (1536, [("q_b", 128 * 192), ("wq_b", 64 * 128)]),
    "shared_expert": (7168, [("gate", 2048), ("up", 2048)]),
    "dense_mlp": (7168, [("gate", 18432), ("up", 18432)]),
}
# The norm that produces each group's input in the forward, as (residual add before it, its bf16 rows read by
# another layer too): the input norm (x + mlp; the indexer's fp32 weights_proj reads it), the query latent's norm,
# a dense layer's post-attention norm (x + attn).  The fuse_norm_into_quantization pass quantises inside these; a
# MoE layer's shared expert reads compacted rows, so its group has none.
GROUP_NORMS = {"attn_input": (True, True), "q_latent": (False, False), "dense_mlp": (True, False)}
ROWS = (256, 1024, 4096, 8192, 16384, 32768)
# Triton tile variants for --sweep: (BM, BN, num_warps, num_stages).
SWEEP = [(128, 128, 8, 4), (128, 128, 8, 3), (128, 128, 4, 3), (128, 256, 8, 3), (64, 128, 4, 4), (64, 128, 4, 3),
         (64, 256, 4, 3), (128, 64, 4, 4), (256, 128, 8, 3)]


BUDGET_MS = float(os.environ.get("FP8_BENCH_BUDGET_MS", "300"))


GRAPH = False  # --graph: time CUDA-graph replays (device time only, as the captured forward runs)


KERNELS = False  # --kernels: each group's variants also profiled, kernel by kernel (the replays' device time)


def as_timed(fn):
    """``fn`` called once (compiling, autotuning and binding outside any capture), then, with ``--graph``, the
    replay of a CUDA graph that captured one more call: what the timing and the profile run."""
    fn()
    torch.cuda.synchronize()
    if GRAPH:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        fn = graph.replay
        fn()
        torch.cuda.synchronize()
    return fn


def print_kernels(label: str, fn, replays: int = 20) -> None:
    """The kernels of one call as the graphed forward runs them: ``fn`` captured once (with ``--graph``) and
    ``replays`` replays profiled; each kernel's mean device µs a call, then their sum against the replay's own
    time (a gap between them is time between kernels, not in them)."""
    from torch.profiler import ProfilerActivity, profile

    fn = as_timed(fn)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
        torch.cuda.synchronize()
    rows = [(e.self_device_time_total / replays, e.count // replays, e.key) for e in prof.key_averages()
            if e.self_device_time_total > 0]
    rows.sort(reverse=True)
    print(f"    kernels of '{label}' ({'graph replays' if GRAPH else 'eager calls'}, mean of {replays}): "
          f"{sum(r[0] for r in rows):.1f} us in kernels")
    for us, calls, name in rows[:8]:
        print(f"      {us:8.1f} us  x{calls}  {name[:110]}")


def time_ms(fn, budget_ms: float | None = None, min_reps: int = 5, max_reps: int = 100) -> float:
    """Median of CUDA-event timings, reps chosen to fill ``budget_ms`` (``$FP8_BENCH_BUDGET_MS``, default 300).

    Eagerly, a call's host work (Python wrappers, Triton's launcher) shows whenever it exceeds the
    kernels' GPU time, which at M = 4096 it can; with ``--graph`` each call is captured once and the
    replays are timed.
    """
    budget_ms = BUDGET_MS if budget_ms is None else budget_ms
    fn = as_timed(fn)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    torch.cuda.synchronize()
    once = max(start.elapsed_time(stop), 1e-3)
    reps = int(min(max_reps, max(min_reps, budget_ms / once)))
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def make_case(M: int, N: int, K: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w_bf16 = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    nb, kb = -(-N // 128), -(-K // 128)
    blocks = torch.nn.functional.pad(w_bf16.float(), (0, kb * 128 - K, 0, nb * 128 - N)).view(nb, 128, kb, 128)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448
    w = (blocks / scale[:, None, :, None]).view(nb * 128, kb * 128)[:N, :K].clamp(-448, 448).to(torch.float8_e4m3fn)
    return x, w.contiguous(), scale.contiguous(), w_bf16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated M values")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated names from {', '.join(SHAPES)}")
    ap.add_argument("--json", help="write the rows as JSON here")
    ap.add_argument("--check", action="store_true", help="compare with the torch reference first")
    ap.add_argument("--sweep", action="store_true", help="also time the Triton tile variants")
    ap.add_argument("--pow2", type=int, default=1, help="ue8m0 activation scales (1, V3.2's recipe) or fp32 (0)")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays instead of eager calls")
    ap.add_argument("--kernels", action="store_true",
                    help="also profile each group's variants behind their norm, kernel by kernel")
    ap.add_argument("--groups", default=",".join(GROUPS),
                    help=f"projections sharing an input, timed as one quantisation + their GEMMs against bf16 and "
                         f"against a quantisation each (comma-separated from {', '.join(GROUPS)}; '' for none)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("fp8_linear_bench: needs a CUDA device", file=sys.stderr)
        return 2
    global GRAPH, KERNELS
    GRAPH, KERNELS = args.graph, args.kernels
    import cpgraph.ops  # noqa: F401
    from cpgraph.kernels import fp8_linear as kernel
    from cpgraph.ops.fp8_linear import fp8_block_linear_reference

    rows_list = [int(r) for r in args.rows.split(",")]
    names = [n for n in args.shapes.split(",") if n]  # --shapes "": the groups only
    pow2 = bool(args.pow2)
    out = []
    print(f"{'shape':>15} {'M':>6} {'impl':>22} {'ms':>8} {'TFLOP/s':>8} {'x bf16':>7} {'quant ms':>8} "
          f"{'gemm ms':>8} {'gemm x bf16':>11}")
    for name in names:
        N, K = SHAPES[name]
        for M in rows_list:
            x, w, ws, w_bf16 = make_case(M, N, K)
            flops = 2 * M * N * K
            bf16_ms = time_ms(lambda: x @ w_bf16.t())
            quant_ms = time_ms(lambda: kernel.quantize_activations(x, 128, pow2))
            xq, xs = kernel.quantize_activations(x, 128, pow2)
            xq_c, xs_c = kernel.quantize_activations(x, 128, pow2, scales_column_major=True)
            impls = {}
            impls["triton"] = (
                lambda t=None: kernel.block_scaled_gemm(*kernel.quantize_activations(x, 128, pow2), w, ws,
                                                        128, 128, torch.bfloat16, tiles=t),
                lambda t=None: kernel.block_scaled_gemm(xq, xs, w, ws, 128, 128, torch.bfloat16, tiles=t),
            )
            reason = kernel.scaled_mm_reason(x, w, 128, 128)
            if reason is None:
                def scaled(t=None):
                    q, sc = kernel.quantize_activations(x, 128, pow2, scales_column_major=True)
                    return kernel.scaled_mm_gemm(q, sc, w, ws, torch.bfloat16)
                impls["scaled_mm"] = (scaled, lambda t=None: kernel.scaled_mm_gemm(xq_c, xs_c, w, ws, torch.bfloat16))
            dg_reason = kernel._deep_gemm_reason(x) or kernel.deep_gemm_operand_reason(x.dtype, w, 128, 128)
            if dg_reason is None:  # what CPGRAPH_FP8_LINEAR=auto runs where DeepGEMM is installed
                def deep(t=None):
                    q, sc = kernel.quantize_activations(x, 128, pow2, scales_column_major=True)
                    return kernel.deep_gemm_linear(q, sc, w, ws, torch.bfloat16)
                impls["deep_gemm"] = (deep, lambda t=None: kernel.deep_gemm_linear(xq_c, xs_c, w, ws, torch.bfloat16))
            variants = [(k, fns, None) for k, fns in impls.items()]
            if args.sweep:
                variants += [(f"triton {t[0]}x{t[1]} w{t[2]} s{t[3]}", impls["triton"], t) for t in SWEEP]
            rows = [("bf16", bf16_ms, None, None)]
            for label, (fn, gemm_fn), tiles in variants:
                call = lambda fn=fn, tiles=tiles: fn(tiles)  # noqa: E731
                if args.check:
                    got = call()[:256].float()
                    want = fp8_block_linear_reference(x[:256].float(), w, ws, 128, 128, pow2)
                    err = float((got - want).abs().max() / want.abs().max())
                    if err > 2**-7:
                        print(f"fp8_linear_bench: {label} {name} M={M}: relative error {err:.2e}", file=sys.stderr)
                        return 1
                rows.append((label, time_ms(call), quant_ms, time_ms(lambda g=gemm_fn, t=tiles: g(t))))
            if "scaled_mm" not in impls:
                print(f"{name:>15} {M:>6} {'scaled_mm skipped':>22}  ({reason})")
            if "deep_gemm" not in impls:
                print(f"{name:>15} {M:>6} {'deep_gemm skipped':>22}  ({dg_reason})")
            for label, ms, q, gms in rows:
                tflops = flops / ms / 1e9
                qtxt = f"{q:8.3f}" if q is not None else " " * 8
                gtxt = f"{gms:8.3f} {bf16_ms / gms:11.2f}" if gms is not None else ""
                print(f"{name:>15} {M:>6} {label:>22} {ms:8.3f} {tflops:8.1f} {bf16_ms / ms:7.2f} {qtxt} {gtxt}")
                out.append({"shape": name, "N": N, "K": K, "M": M, "impl": label, "ms": ms, "tflops": tflops,
                            "x_bf16": bf16_ms / ms, "quant_ms": q, "gemm_ms": gms,
                            "gemm_x_bf16": None if gms is None else bf16_ms / gms})
                sys.stdout.flush()
            if args.json:  # written after every case: a run cut short still leaves its rows
                write_json(args.json, out, pow2, kernel)
            del x, w, ws, w_bf16, xq, xs, xq_c, xs_c
            torch.cuda.empty_cache()
    for name in [g for g in args.groups.split(",") if g]:
        for M in rows_list:
            out += time_group(name, M, pow2, args.check)
            if args.json:
                write_json(args.json, out, pow2, kernel)
    return 0


def time_group(name: str, M: int, pow2: bool, check: bool) -> list[dict]:
    """One input, several projections: bf16 GEMMs vs FP8 with one quantisation each vs one shared quantisation
    (the ops the compiled forward runs: ``fp8_block_linear`` each, or ``fp8_quantize_activations`` +
    ``fp8_linear_quantized`` after the share pass; their GEMM is the one ``auto`` picks)."""
    ops = torch.ops.cpgraph
    K, projs = GROUPS[name]
    cases = [make_case(M, N, K, seed=i) for i, (_, N) in enumerate(projs)]
    x = cases[0][0]
    weights = [(w, ws, w_bf16) for _, w, ws, w_bf16 in cases]
    flops = sum(2 * M * N * K for _, N in projs)

    def bf16():
        return [x @ wb.t() for _, _, wb in weights]

    def separate():
        return [ops.fp8_block_linear(x, w, ws, 128, 128, pow2) for w, ws, _ in weights]

    def shared():
        q, sc = ops.fp8_quantize_activations(x, 128, pow2)
        return [ops.fp8_linear_quantized(q, sc, w, ws, 128, 128, torch.bfloat16) for w, ws, _ in weights]

    if check:
        for a, b in zip(separate(), shared()):
            if not torch.equal(a, b):
                raise SystemExit(f"fp8_linear_bench: group {name} M={M}: the shared quantisation changed a result")
    times = {"bf16": time_ms(bf16), "fp8, a quantisation each": time_ms(separate),
             "fp8, one quantisation": time_ms(shared)}
    quant_ms = time_ms(lambda: ops.fp8_quantize_activations(x, 128, pow2))
    baseline = {impl: "bf16" for impl in times}
    if name in GROUP_NORMS:  # the same with the norm producing x: what the forward runs before and after fusing
        times.update(time_with_norm(x, weights, K, M, pow2, *GROUP_NORMS[name], check))
        baseline.update({impl: "bf16 + norm" for impl in times if "norm" in impl})
    label = "+".join(p for p, _ in projs)
    rows = []
    for impl, ms in times.items():
        base = times[baseline[impl]]
        print(f"{label:>15} {M:>6} {impl:>30} {ms:8.3f} {flops / ms / 1e9:8.1f} {base / ms:7.2f} "
              f"{quant_ms if impl != 'bf16' else float('nan'):8.3f}")
        rows.append({"shape": name, "projections": [p for p, _ in projs], "K": K, "M": M, "impl": impl, "ms": ms,
                     "tflops": flops / ms / 1e9, "x_bf16": base / ms, "baseline": baseline[impl],
                     "quant_ms": quant_ms})
    sys.stdout.flush()
    del cases, weights, x
    torch.cuda.empty_cache()
    return rows


def time_with_norm(x, weights, K: int, M: int, pow2: bool, residual: bool, emit: bool, check: bool) -> dict:
    """The group with the RMSNorm (and residual add) that produces its input, three ways: bf16 GEMMs after
    Inductor's add + norm kernel (the bf16 forward), FP8 with one quantisation after that kernel (before
    ``fuse_norm_into_quantization``), and FP8 quantised inside the norm (``fp8_rms_norm_quantize``, after it)."""
    import torch.nn.functional as F

    ops = torch.ops.cpgraph
    g = torch.Generator(device="cuda").manual_seed(7)
    res = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16) if residual else None
    w_norm = (torch.rand(K, device="cuda", generator=g) + 0.5).to(torch.bfloat16)

    @torch.compile(dynamic=False)
    def inductor_norm(x, res, w_norm):
        s = x + res if res is not None else x
        return s, F.rms_norm(s, (K,), w_norm, 1e-6)

    def bf16():
        s, h = inductor_norm(x, res, w_norm)
        return [h @ wb.t() for _, _, wb in weights]

    def quant_after_norm():
        s, h = inductor_norm(x, res, w_norm)
        q, sc = ops.fp8_quantize_activations(h, 128, pow2)
        return [ops.fp8_linear_quantized(q, sc, w, ws, 128, 128, torch.bfloat16) for w, ws, _ in weights]

    def quant_in_norm():
        _s, _h, q, sc = ops.fp8_rms_norm_quantize(x, res, w_norm, 1e-6, 128, pow2, emit)
        return [ops.fp8_linear_quantized(q, sc, w, ws, 128, 128, torch.bfloat16) for w, ws, _ in weights]

    if check:  # within an FP8 step: the two norms may differ in a value's last bit, moving a code by one step
        for a, b in zip(quant_after_norm(), quant_in_norm()):
            err = float((a.float() - b.float()).abs().max() / b.float().abs().max())
            if err > 2**-3:
                raise SystemExit(f"fp8_linear_bench: M={M}: quantising in the norm is {err:.3g} off the unfused result")
    variants = {"bf16 + norm": bf16, "fp8 + norm, quantised after it": quant_after_norm,
                "fp8, quantised in the norm": quant_in_norm}
    if KERNELS:
        for label, fn in variants.items():
            print_kernels(f"M={M} {label}", fn)
    return {label: time_ms(fn) for label, fn in variants.items()}


def write_json(path, rows, pow2, kernel) -> None:
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "pow2": pow2, "cuda_graph": GRAPH,
            "backend_env": os.environ.get(kernel.BACKEND_ENV, "auto")}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
