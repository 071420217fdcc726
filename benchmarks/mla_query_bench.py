"""Sparse-MLA query assembly: the ``cpgraph::mla_query`` op vs the torch composition it replaced.

Times ``RotaryTable`` + ``MLAttention.query`` -- ``q_b_proj``, the W_UK absorption, RoPE on
``q_pe`` and the assembly into ``[M, H, 576]`` -- on DeepSeek-V3.2 attention (``--heads 128`` is
the released size; 64 the kernel-shaped config of benchmarks/cuda_graph_bench.py; kv_lora 512,
rope 64).  Variants, each timed in this one run:

* ``torch-compiled``: the previous model code (einsum + RoPE + ``cat``) under Inductor, rotary
  tables stored once: Inductor adds one pointwise kernel that re-reads the ``[H, M, 512]`` bmm
  output transposed and writes the concatenation;
* ``op-eager`` / ``op-compiled``: the model as it is (``cpgraph::mla_query``; on CUDA the GEMM
  writes straight into the final layout and a small kernel rotates the 64 RoPE lanes);
* ``gemm-floor``: ``q_b_proj`` plus a plain contiguous bmm of the same size, the cost with no
  assembly at all.  ``assembly ms`` = variant - floor.

The output side, on random ``[M, H, 512]`` attention outputs and the layer's W_UV: ``output
torch-compiled`` (the previous model code, ``einsum(...).reshape(M, H * v)`` under Inductor, which
re-reads the ``[H, M, v]`` bmm output transposed), ``output op-compiled`` (``cpgraph::mla_output``:
on CUDA the bmm writes the ``[M, H * v]`` rows directly) and ``output bmm floor`` (the same bmm into
a contiguous ``[H, M, v]``, what the GEMM alone costs).

Figures are medians of per-call times (CUDA events on GPU, wall clock on CPU) and ratios within
the run; the copy rate of the same run turns the assembly's bytes into a share of HBM speed.
``--device cpu`` is a dry run at small sizes.  Also checks that every variant matches the op's
eager result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_graph_bench import KERNEL_SHAPED  # noqa: E402


def _attention(device, dtype, heads):
    from cpgraph.models import DSAConfig
    from cpgraph.models.attention import MLAttention
    from cpgraph.models.config import bundled_config_dict
    from cpgraph.models.layers import RotaryTable

    cfg = DSAConfig.from_hf_dict(dict(bundled_config_dict("tiny-deepseek-v32"), **dict(KERNEL_SHAPED,
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=1536 if heads == 128 else 512)))
    torch.manual_seed(0)
    attn = MLAttention(cfg, 0)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.02)
    rot = RotaryTable(cfg.rope, cfg.qk_rope_head_dim)
    return cfg, attn.to(device=device, dtype=dtype).eval(), rot.to(device)


def _time_ms(fn, args, repeat, device) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(repeat):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(*args)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    else:
        for _ in range(repeat):
            t = time.perf_counter()
            fn(*args)
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", default=None, help="comma-separated M (default 8192,32768 on CUDA, 64 on CPU)")
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    dtype = torch.float32 if cpu else torch.bfloat16
    rows = [int(r) for r in (args.rows or ("64" if cpu else "8192,32768")).split(",")]
    repeat = args.repeat or (5 if cpu else 20)

    from cpgraph.ops.mla_output import mla_output_reference
    from cpgraph.ops.mla_query import mla_query_reference

    cfg, attn, rot = _attention(device, dtype, args.heads)
    H, L, R, nope = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim

    def op_query(q_lat, positions):
        cos, sin = rot(positions, q_lat.dtype)
        return attn.query(q_lat, cos, sin)

    def torch_query(q_lat, positions):
        cos, sin = rot(positions, q_lat.dtype)
        q = attn.q_b_proj(q_lat).view(q_lat.shape[0], H, nope + R)
        return mla_query_reference(q, attn._absorbed()[0], cos, sin)

    w_floor = torch.randn(H, nope, L, device=device, dtype=dtype)

    def gemm_floor(q_lat, positions):
        q = attn.q_b_proj(q_lat).view(H, q_lat.shape[0], nope + R)[:, :, :nope]
        return torch.bmm(q, w_floor)

    copy_gbs = None
    if not cpu:
        buf = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
        copy_ms = _time_ms(lambda: buf.clone(), (), repeat, device)
        copy_gbs = 2 * buf.numel() * 2 / copy_ms / 1e6  # bytes read + written
        del buf
    results = []
    with torch.no_grad():
        for m in rows:
            q_lat = torch.randn(m, cfg.q_lora_rank, device=device, dtype=dtype)
            positions = torch.arange(m, device=device) % 8192
            ref = op_query(q_lat, positions)
            row = {"rows": m, "op_eager_ms": _time_ms(op_query, (q_lat, positions), repeat, device),
                   "gemm_floor_ms": _time_ms(gemm_floor, (q_lat, positions), repeat, device)}
            for name, f in (("torch_compiled", torch_query), ("op_compiled", op_query)):
                torch._dynamo.reset()
                fn = torch.compile(f, fullgraph=True)
                out = fn(q_lat, positions)
                row[f"{name}_ms"] = _time_ms(fn, (q_lat, positions), repeat, device)
                row[f"{name}_max_abs_diff"] = (out.float() - ref.float()).abs().max().item()
            # What the assembly must at least move: read q's RoPE lanes, write [M, H, L + R].
            row["assembly_torch_ms"] = row["torch_compiled_ms"] - row["gemm_floor_ms"]
            row["assembly_op_ms"] = row["op_compiled_ms"] - row["gemm_floor_ms"]
            row["torch_over_op"] = row["torch_compiled_ms"] / row["op_compiled_ms"]
            # The output side: out_lat @ W_UV^T as the [M, H * v] rows o_proj reads (cpgraph::mla_output).
            out_lat = torch.randn(m, H, L, device=device, dtype=dtype)
            w_uv = attn._absorbed()[1]
            want = mla_output_reference(out_lat, w_uv)
            for name, f in (("output_torch_compiled", mla_output_reference),
                            ("output_op_compiled", lambda a, w: torch.ops.cpgraph.mla_output(a, w))):
                torch._dynamo.reset()
                fn = torch.compile(f, fullgraph=True)
                got = fn(out_lat, w_uv)
                row[f"{name}_ms"] = _time_ms(fn, (out_lat, w_uv), repeat, device)
                row[f"{name}_max_abs_diff"] = (got.float() - want.float()).abs().max().item()
            w_plain = w_uv.transpose(1, 2).contiguous()
            row["output_gemm_floor_ms"] = _time_ms(lambda a: torch.bmm(a, w_plain), (out_lat.transpose(0, 1),),
                                                   repeat, device)
            row["output_torch_over_op"] = row["output_torch_compiled_ms"] / row["output_op_compiled_ms"]
            results.append(row)
            print(f"M={m:6d} H={H}  output: torch-compiled {row['output_torch_compiled_ms']:.3f} ms, op-compiled "
                  f"{row['output_op_compiled_ms']:.3f} ms ({row['output_torch_over_op']:.2f}x), bmm floor "
                  f"{row['output_gemm_floor_ms']:.3f} ms  |diff| torch {row['output_torch_compiled_max_abs_diff']:.2e} "
                  f"op {row['output_op_compiled_max_abs_diff']:.2e}", flush=True)
            print(f"M={m:6d} H={H}  torch-compiled {row['torch_compiled_ms']:.3f} ms  op-compiled "
                  f"{row['op_compiled_ms']:.3f} ms  op-eager {row['op_eager_ms']:.3f} ms  gemm floor "
                  f"{row['gemm_floor_ms']:.3f} ms  -> assembly {row['assembly_torch_ms']:.3f} -> "
                  f"{row['assembly_op_ms']:.3f} ms ({row['torch_over_op']:.2f}x whole query)  |diff| torch "
                  f"{row['torch_compiled_max_abs_diff']:.2e} op {row['op_compiled_max_abs_diff']:.2e}", flush=True)
    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype), "heads": H, "kv_lora": L, "rope": R, "copy_gbs": copy_gbs, "results": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
