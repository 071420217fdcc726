"""Routed-expert cost: ``cpgraph::moe_experts`` (grouped GEMMs) vs the dense form, on one GPU.

Shapes: ``kernel`` = the kernel-shaped bench model's MoE (H 2048, I 512, 8 experts, top-2);
``v3`` = DeepSeek-V3.2's (H 7168, I 2048, 256 experts, top-8; 22.5 GB of bf16 expert weights).
Routing: ``uniform`` (random distinct experts per row) or ``skewed`` (expert 0 in every row's
first slot).  ``--valid`` bounds the real rows (the rest are padding that must cost nothing).
Reports median ms, routed TFLOP/s (``6 * H * I * top_k`` per real row) and its share of a dense
bf16 GEMM measured in the same run; the dense form (every expert on every row) is timed where
it fits (``--dense-max-rows``), and the max |diff| between both is printed.

    python benchmarks/moe_bench.py [--shapes kernel,v3] [--rows 2048,8192,32768] [--json out.json]

``--fp8``: FP8 experts instead (e4m3 weights with 128 x 128 block scales, quantised here from the
bf16 ones by the published recipe, ue8m0 activation scales): per shape / rows / routing, the whole
op with FP8 experts (Triton grouped FP8 GEMMs) against the same op with the bf16 experts
(``torch._grouped_mm``) in the same run, their ratio, and the relative L2 difference of the two
outputs (the activation quantisation); then the gate/up GEMM alone, FP8 Triton tile variants
(``--tiles``) against ``torch._grouped_mm`` on the same dispatch.

    python benchmarks/moe_bench.py --fp8 --shapes v3 --rows 4096,16384 --routing uniform --json fp8.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

SHAPES = {"kernel": (2048, 512, 8, 2), "v3": (7168, 2048, 256, 8)}


def time_ms(fn, repeat: int) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def routing(M: int, E: int, k: int, skewed: bool, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(M, E, generator=g).argsort(dim=1)[:, :k]
    if skewed:  # expert 0 first in every row, the other slots avoid it
        ids = torch.rand(M, E - 1, generator=g).argsort(dim=1)[:, : k - 1] + 1
        ids = torch.cat([torch.zeros(M, 1, dtype=ids.dtype), ids], dim=1)
    w = torch.rand(M, k, generator=g) + 0.1
    return ids, w / w.sum(-1, keepdim=True)


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, N, K]`` -> e4m3 and ``[E, N/128, K/128]`` scales (``amax / 448`` per block), one expert at a time."""
    E, N, K = w.shape
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty(E, -(-N // 128), -(-K // 128), dtype=torch.float32, device=w.device)
    for e in range(E):
        blocks = torch.nn.functional.pad(w[e].float(), (0, s.shape[2] * 128 - K, 0, s.shape[1] * 128 - N))
        blocks = blocks.view(s.shape[1], 128, s.shape[2], 128)
        s[e] = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448
        q[e] = (blocks / s[e][:, None, :, None]).clamp(-448, 448).view(s.shape[1] * 128, -1)[:N, :K].to(q.dtype)
    return q, s


# (BM, BN, warps, stages[, group_t[, pair_k]]): group_t > 1 is the grouped raster order (row tiles of a
# group share L2 while every column tile passes over them), 1 the 2-D grid; pair_k: two K blocks per step.
TILES = [None, (64, 128, 4, 4, 1), (64, 128, 4, 4, 16), (64, 128, 4, 4, 32), (128, 128, 8, 3, 16),
         (128, 128, 8, 3, 16, 1), (128, 128, 8, 3, 32, 1), (128, 128, 8, 2, 16, 1), (64, 128, 4, 4, 16, 1)]


def fp8_main(args) -> None:
    from cpgraph.kernels.fp8_grouped import grouped_gemm
    from cpgraph.kernels.fp8_linear import quantize_activations
    from cpgraph.ops.moe import dispatch_plan

    ops = torch.ops.cpgraph
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    print(f"moe_bench --fp8 on {name}")
    print(f"{'shape':<6}{'rows':>7}{'routing':>9} {'impl':>26}{'ms':>9}{'TFLOP/s':>9}{'x bf16':>8}{'relL2':>8}")
    rows_out = []
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        H, I, E, k = SHAPES[shape]
        gate_up = (torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * H**-0.5)
        down = (torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * I**-0.5)
        gq, gs = quantize_experts(gate_up)
        dq, ds = quantize_experts(down)
        for M in (int(r) for r in args.rows.split(",")):
            x = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
            nv = torch.tensor([M], device=dev)
            for mode in args.routing.split(","):
                ids, w = (t.to(dev) for t in routing(M, E, k, mode == "skewed", g))
                bf16 = lambda: ops.moe_experts(x, ids, w, gate_up, down, nv)  # noqa: E731
                fp8 = lambda: ops.moe_experts(x, ids, w, gq, dq, nv, gs, ds, 128, 128, True)  # noqa: E731
                a, b = bf16().float(), fp8().float()
                rel = float((a - b).norm() / a.norm())
                flops = 6 * H * I * k * M
                t_bf16 = time_ms(bf16, args.repeat)
                t_fp8 = time_ms(fp8, args.repeat)
                for impl, t in (("op bf16 (_grouped_mm)", t_bf16), ("op fp8 (triton)", t_fp8)):
                    ratio = t_bf16 / t
                    rows_out.append({"shape": shape, "rows": M, "routing": mode, "impl": impl, "ms": t,
                                     "tflops": flops / t / 1e9, "x_bf16": ratio, "rel_l2_vs_bf16": rel})
                    print(f"{shape:<6}{M:>7}{mode:>9} {impl:>26}{t:>9.3f}{flops / t / 1e9:>9.0f}{ratio:>8.2f}{rel:>8.3f}")
                # Each grouped GEMM alone on the same dispatch: gate/up (K = H), then down (K = I).
                plan = dispatch_plan(ids, nv, E)
                src = plan.order // k
                xs = x.index_select(0, src)
                xq, xsc = quantize_activations(x, 128, True)
                hs = torch.randn(M * k, I, device=dev, dtype=torch.bfloat16)
                hq, hsc = quantize_activations(hs, 128, True)
                gemms = (("gate_up", xs, gate_up, (xq, xsc, src, gq, gs), 2 * I * H),
                         ("down", hs, down, (hq, hsc, None, dq, ds), H * I))
                for which, a_bf16, w_bf16, fp8_args, per_row in gemms:
                    t_gm = time_ms(lambda: torch._grouped_mm(a_bf16, w_bf16.transpose(1, 2), offs=plan.group_ends),
                                   args.repeat)
                    gflops = 2 * per_row * k * M
                    rows_out.append({"shape": shape, "rows": M, "routing": mode, "impl": f"{which} _grouped_mm bf16",
                                     "ms": t_gm, "tflops": gflops / t_gm / 1e9, "x_bf16": 1.0})
                    print(f"{shape:<6}{M:>7}{mode:>9} {which + ' bf16':>26}{t_gm:>9.3f}{gflops / t_gm / 1e9:>9.0f}"
                          f"{1.0:>8.2f}")
                    ref = grouped_gemm(*fp8_args, plan.group_ends, 128, 128, torch.bfloat16, M * k)
                    for tiles in TILES if args.tiles else TILES[:1]:
                        fn = lambda tiles=tiles: grouped_gemm(*fp8_args, plan.group_ends, 128, 128,  # noqa: E731
                                                              torch.bfloat16, M * k, tiles=tiles)
                        if tiles is not None and tiles[:4] == (64, 128, 4, 4) and not torch.equal(fn(), ref):
                            raise SystemExit(f"{which} {tiles}: the raster order changed the result")
                        try:
                            t = time_ms(fn, args.repeat)
                        except Exception as exc:  # e.g. a tile over the shared-memory limit: reported, not fatal
                            print(f"{shape:<6}{M:>7}{mode:>9} {which} fp8 {tiles}: failed: {str(exc)[:120]}")
                            continue
                        label = f"{which} fp8 " + ("default" if tiles is None else "x".join(map(str, tiles)))
                        rows_out.append({"shape": shape, "rows": M, "routing": mode, "impl": label, "tiles": tiles,
                                         "ms": t, "tflops": gflops / t / 1e9, "x_bf16": t_gm / t})
                        print(f"{shape:<6}{M:>7}{mode:>9} {label:>26}{t:>9.3f}{gflops / t / 1e9:>9.0f}{t_gm / t:>8.2f}")
                    del ref
                del hs, hq, hsc
                del xs, xq, xsc
            del x
        del gate_up, down, gq, gs, dq, ds
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": rows_out}, indent=2))


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="kernel,v3")
    ap.add_argument("--rows", default="2048,8192,32768")
    ap.add_argument("--routing", default="uniform,skewed")
    ap.add_argument("--valid", type=float, default=1.0, help="fraction of rows that are real (rest: padding)")
    ap.add_argument("--dense-max-rows", type=int, default=8192, help="time the dense form up to this many rows")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--fp8", action="store_true", help="FP8 experts vs bf16 experts (see the module docstring)")
    ap.add_argument("--tiles", action="store_true", help="with --fp8: also time the grouped GEMM's tile variants")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("moe_bench: needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if args.fp8:
        return fp8_main(args)
    from cpgraph.ops.moe import moe_experts_reference
    from cpgraph.ops.providers import active_provider, bind_providers

    bind_providers("cuda")

    ops = torch.ops.cpgraph
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    gemm = 2 * n**3 / (time_ms(lambda: a @ a, args.repeat) * 1e-3) / 1e12
    del a
    print(f"moe_bench on {name}: provider {active_provider('moe_experts', 'cuda')!r}, dense bf16 GEMM {gemm:.0f} TFLOP/s")
    print(f"{'shape':<8}{'rows':>8}{'valid':>8}{'routing':>9}{'ms':>9}{'TFLOP/s':>9}{'%GEMM':>7}{'dense ms':>10}{'max|d|':>9}")
    rows_out = []
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        H, I, E, k = SHAPES[shape]
        gate_up = (torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * H**-0.5)
        down = (torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * I**-0.5)
        for M in (int(r) for r in args.rows.split(",")):
            x = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
            V = max(0, min(M, round(M * args.valid)))
            nv = torch.tensor([V], device=dev)
            for mode in args.routing.split(","):
                ids, w = (t.to(dev) for t in routing(M, E, k, mode == "skewed", g))
                fn = lambda: ops.moe_experts(x, ids, w, gate_up, down, nv)  # noqa: E731
                ms = time_ms(fn, args.repeat)
                tflops = 6 * H * I * k * V / (ms * 1e-3) / 1e12
                row = {"shape": shape, "rows": M, "valid": V, "routing": mode, "ms": ms, "tflops": tflops,
                       "share_of_dense_gemm": tflops / gemm}  # fmt: skip
                dense_ms = diff = None
                if M * E <= args.dense_max_rows * 8:
                    dense = lambda: moe_experts_reference(x, ids, w, gate_up, down, nv)  # noqa: E731
                    dense_ms = time_ms(dense, max(2, args.repeat // 3))
                    diff = (fn().float() - dense().float()).abs().max().item()
                    row.update(dense_ms=dense_ms, max_abs_diff=diff)
                rows_out.append(row)
                dm = f"{dense_ms:.2f}" if dense_ms is not None else "-"
                dd = f"{diff:.3g}" if diff is not None else "-"
                print(f"{shape:<8}{M:>8}{V:>8}{mode:>9}{ms:>9.3f}{tflops:>9.0f}{100 * tflops / gemm:>6.1f}%{dm:>10}{dd:>9}")
            del x
        del gate_up, down
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"device": name, "dense_gemm_tflops": gemm, "rows": rows_out}, indent=2))


if __name__ == "__main__":
    main()
