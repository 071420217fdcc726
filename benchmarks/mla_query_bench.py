"""Sparse-MLA query assembly: eager vs compiled, rotary tables inlined (before) vs stored once (after).

Times ``RotaryTable`` + ``MLAttention.query`` -- ``q_b_proj``, the W_UK
absorption bmm, RoPE on ``q_pe`` and the ``cat`` into ``[M, H, 576]`` -- on
the kernel-shaped DeepSeek-V3.2 attention of benchmarks/cuda_graph_bench.py
(64 heads, kv_lora 512, rope 64).  Variants, each timed in this one run:

* ``eager``: the model code as written;
* ``compiled-inline``: Inductor with the rotary tables left unstored (the old
  behaviour: Inductor inlines ``cos``/``sin`` into the fused query kernel and
  recomputes them per (row, head, lane));
* ``compiled``: the model as it is (tables stored once, ``layers._stored_once``).

Figures are medians of per-call times (CUDA events on GPU, wall clock on
CPU) and ratios within the run.  ``--device cpu`` is a dry run at small sizes.
Also checks that both compiled variants match eager.
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


def _attention(device, dtype):
    from cpgraph.models import DSAConfig
    from cpgraph.models.attention import MLAttention
    from cpgraph.models.config import bundled_config_dict
    from cpgraph.models.layers import RotaryTable

    cfg = DSAConfig.from_hf_dict(dict(bundled_config_dict("tiny-deepseek-v32"), **KERNEL_SHAPED))
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
    ap.add_argument("--rows", default=None, help="comma-separated M (default 1024,8192 on CUDA, 64 on CPU)")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    dtype = torch.float32 if cpu else torch.bfloat16
    rows = [int(r) for r in (args.rows or ("64" if cpu else "1024,8192")).split(",")]
    repeat = args.repeat or (5 if cpu else 50)

    import cpgraph.models.layers as layers

    cfg, attn, rot = _attention(device, dtype)

    def query(q_lat, positions):
        cos, sin = rot(positions, q_lat.dtype)
        return attn.query(q_lat, cos, sin)

    stored_once = layers._stored_once
    results = []
    with torch.no_grad():
        for m in rows:
            q_lat = torch.randn(m, cfg.q_lora_rank, device=device, dtype=dtype)
            positions = torch.arange(m, device=device) % 8192
            ref = query(q_lat, positions)
            row = {"rows": m, "eager_ms": _time_ms(query, (q_lat, positions), repeat, device)}
            for name, table_fn in (("compiled_inline", lambda t: t), ("compiled", stored_once)):
                layers._stored_once = table_fn  # RotaryTable.forward looks it up at trace time
                try:
                    torch._dynamo.reset()
                    fn = torch.compile(query, fullgraph=True)
                    out = fn(q_lat, positions)
                    row[f"{name}_ms"] = _time_ms(fn, (q_lat, positions), repeat, device)
                    row[f"{name}_max_abs_diff"] = (out.float() - ref.float()).abs().max().item()
                finally:
                    layers._stored_once = stored_once
            row["inline_over_stored"] = row["compiled_inline_ms"] / row["compiled_ms"]
            row["eager_over_compiled"] = row["eager_ms"] / row["compiled_ms"]
            results.append(row)
            print(
                f"M={m:6d}  eager {row['eager_ms']:.3f} ms  compiled(inline tables) {row['compiled_inline_ms']:.3f} ms"
                f"  compiled(stored tables) {row['compiled_ms']:.3f} ms  inline/stored {row['inline_over_stored']:.2f}x"
                f"  |diff| inline {row['compiled_inline_max_abs_diff']:.2e} stored {row['compiled_max_abs_diff']:.2e}",
                flush=True,
            )
    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "heads": cfg.num_attention_heads,
        "kv_lora": cfg.kv_lora_rank,
        "rope": cfg.qk_rope_head_dim,
        "results": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
