"""Radix prefix cache: match and re-insert of a 65,536-token full hit (page 64) on paths of 1/16/128 nodes.

"match" is ``match_prefix`` plus reading the per-page owners and physical
pages of the hit (what the engine consumes); "re-insert" is ``insert`` of the
same key, which walks the path and adopts nothing.  A tree that copies key
slices needs ~9.8 ms for the 128-node match and ~1.2 ms with O(1) key
slicing; the goal here is <= 0.1 ms.

The figure moves with the machine's load (about 0.09 ms idle vs 0.16 ms on a
loaded 2-core box), so the script prints the CPU count and load average with
it, reports the min and the median of 9 repetitions, and judges the goal on
the min (the repetition least disturbed by other processes).

    python benchmarks/radix_bench.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from cpgraph.runtime.radix import RadixCache, TokenKey

TOKENS, PAGE = 65_536, 64


def build(num_nodes: int, cp: int = 8):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 150_000, size=TOKENS)
    tree = RadixCache(PAGE, rank=0, cp_size=cp)
    pages = TOKENS // PAGE
    owners = (np.arange(pages) % cp).astype(np.int8)
    phys = np.where(owners == 0, np.arange(pages), -1)
    per = pages // num_nodes
    # Insert growing prefixes so the path is cut into ``num_nodes`` nodes.
    for k in range(1, num_nodes + 1):
        n = per * k
        tree.insert(TokenKey(tokens[: n * PAGE]), phys[:n], owners[:n], matched_pages=per * (k - 1))
    return tree, tokens, phys, owners


def bench(num_nodes: int, reps: int = 2000, repeats: int = 9) -> dict:
    tree, tokens, phys, owners = build(num_nodes)
    key = TokenKey(tokens)  # built once per request (the request's token array)
    m = tree.match_prefix(key)
    assert len(m.nodes) == num_nodes and m.device_len == TOKENS
    assert np.array_equal(m.device_pages, phys) and np.array_equal(m.page_owners, owners)
    figures = {}
    for name, fn in (
        ("match_s", lambda: (lambda r: (r.page_owners, r.device_pages))(tree.match_prefix(key))),
        ("reinsert_s", lambda: tree.insert(key, phys, owners, matched_pages=TOKENS // PAGE)),
        ("key_build_s", lambda: TokenKey(tokens)),
    ):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t0) / reps)
        figures[name] = min(times)
        figures[name.replace("_s", "_median_s")] = statistics.median(times)
    assert len(list(tree.nodes())) == num_nodes  # re-insert added nothing
    return {"nodes": num_nodes, **figures}


def machine() -> dict:
    """What the figures were measured on: CPU count and 1/5/15-minute load averages."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {"cpus": os.cpu_count(), "loadavg": [round(x, 2) for x in load]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [bench(n) for n in (1, 16, 128)]
    host = machine()
    print(f"machine: {host['cpus']} CPU(s), load average {' / '.join(map(str, host['loadavg']))} (1/5/15 min)")
    for r in rows:
        print(f"{TOKENS}-token full hit, page {PAGE}, {r['nodes']:>3} nodes: "
              f"match {r['match_s'] * 1e3:.4f} ms (median {r['match_median_s'] * 1e3:.4f}), "
              f"re-insert {r['reinsert_s'] * 1e3:.4f} ms (median {r['reinsert_median_s'] * 1e3:.4f}), "
              f"TokenKey build {r['key_build_s'] * 1e3:.4f} ms")
    goal = rows[-1]["match_s"] <= 1e-4
    print(f"goal: 128-node match <= 0.1 ms, judged on the min: {'met' if goal else 'MISSED'} "
          f"({rows[-1]['match_s'] * 1e3:.4f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": TOKENS, "page": PAGE, "machine": host, "rows": rows, "goal_met": goal,
                       "goal_judged_on": "min"}, f, indent=1)


if __name__ == "__main__":
    main()
