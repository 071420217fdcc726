"""Planner cost at a production-sized batch: 10 requests x 100K tokens, cp=8, page 64.

Times building the plan and ONE rank's device bundle on CPU (what each rank does once per batch),
with and without the global rerange index, and compares it with the batch's prefill token count.
Prints a table and writes JSON beside it (benchmarks/results/plan_bench.json).

    python benchmarks/plan_bench.py [--repeat 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from cpgraph.plan import plan_prefill


def time_ms(fn, repeat: int) -> tuple[float, float]:
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples), min(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument("--page", type=int, default=64)
    args = ap.parse_args()
    prefix, extend = [0] * args.requests, [args.tokens] * args.requests

    def build(rerange: bool):
        def run():
            plan = plan_prefill(prefix, extend, cp_size=args.cp, page_size=args.page)
            plan.rank(args.cp // 2, rerange=rerange).to("cpu")

        return run

    rows = []
    for label, rerange in (("plan + rank bundle", False), ("plan + rank bundle + rerange_index", True)):
        med, best = time_ms(build(rerange), args.repeat)
        rows.append({"case": label, "median_ms": med, "min_ms": best, "target_ms": 5.0, "ratio_to_target": med / 5.0})
    shape = f"{args.requests} x {args.tokens} tokens, cp={args.cp}, page={args.page}"
    print(f"plan_bench: {shape} (CPU, one rank's view)")
    print(f"{'case':<40}{'median ms':>12}{'min ms':>10}{'/ 5 ms target':>16}")
    for r in rows:
        print(f"{r['case']:<40}{r['median_ms']:>12.3f}{r['min_ms']:>10.3f}{r['ratio_to_target']:>16.2f}")
    out = Path(__file__).parent / "results" / "plan_bench.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"shape": shape, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
