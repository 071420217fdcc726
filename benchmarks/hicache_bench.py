"""HiCache L2 -> L1 load-back (and L1 -> L2 backup) bandwidth vs a pinned host->device copy of the same bytes.

Builds one rank's device pool (bf16 MLA records, fp8 index-K on the active
index layers, page 64 by default), caches one radix node of ``--pages``
pages, evicts it to the pinned L2 host pool, and times ``HiCache.load_back``
(per-layer copies on the side stream + device scatter into freshly allocated,
owner-preserving pages) against ``torch.Tensor.copy_`` of the same number of
bytes from one pinned buffer, measured in the same run.  Both layouts.

    python benchmarks/hicache_bench.py [--device cuda] [--pages 2048] [--layers 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from cpgraph.runtime.hicache import DevicePages, HiCache, HostPool
from cpgraph.runtime.kv_pool import KVPool, KVPoolConfig
from cpgraph.runtime.radix import RadixCache, TokenKey


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_layout(args, layout: str) -> dict:
    device = torch.device(args.device)
    cfg = KVPoolConfig(num_layers=args.layers, page_size=args.page, num_pages=args.pages + 1, kv_format="dense",
                       kv_lora_rank=512, qk_rope_dim=64, index_head_dim=128,
                       index_layers=list(range(0, args.layers, 2)), dtype=torch.bfloat16, device=device,
                       index_format="fp8")
    pool = KVPool(cfg)
    dev = DevicePages(pool, 1)
    tree = RadixCache(args.page)
    host = HostPool(pool, args.pages, 1, layout)
    hc = HiCache(dev, host, tree, write_policy="write_back")

    def release(node):
        if node.host_pages is None:
            h = hc.backup([node])
            if h is not None:
                h.wait_all()
        dev.free(node.device_pages, node.page_owners)
        return hc.usable_from_host(node)

    owners = np.zeros(args.pages, dtype=np.int64)
    dev.alloc([0])  # page 0 stays taken: loaded pages are shifted vs. host pages (a real scatter)
    tokens = np.random.default_rng(0).integers(0, 100_000, size=args.pages * args.page)
    leaf = tree.insert(TokenKey(tokens), dev.alloc(owners), owners).last_node
    times_load, times_backup = [], []
    for _ in range(args.reps):
        _sync(device)
        t0 = time.perf_counter()
        node_bytes = 0
        handle = hc.backup([leaf]) if leaf.host_pages is None else None
        if handle is not None:
            handle.synchronize()
            _sync(device)
            times_backup.append(time.perf_counter() - t0)
        tree.evict(args.pages, release)
        _sync(device)
        t0 = time.perf_counter()
        handle = hc.load_back([leaf])
        handle.synchronize()
        _sync(device)
        times_load.append(time.perf_counter() - t0)
        node_bytes = handle.bytes
        # Drop the L2 copy too so the next round measures a backup again.
        tree.evict(args.pages, lambda n: dev.free(n.device_pages, n.page_owners) or True)
        hc.release_host(leaf)
        leaf.host_pages, leaf.host_payloads = None, frozenset()
        tree.mark_loaded(leaf, dev.alloc(owners))
    # Baseline: one pinned buffer of the same bytes, copied host -> device.
    pin = device.type == "cuda"
    src = torch.empty(node_bytes, dtype=torch.uint8, pin_memory=pin)
    dst = torch.empty(node_bytes, dtype=torch.uint8, device=device)
    times_h2d = []
    for _ in range(args.reps):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        times_h2d.append(time.perf_counter() - t0)
    best = lambda xs: min(xs[1:] or xs)  # noqa: E731  (first round warms up)
    gbs = lambda t: node_bytes / t / 1e9  # noqa: E731
    return {
        "layout": layout,
        "pages": args.pages,
        "bytes": node_bytes,
        "load_back_s": best(times_load),
        "load_back_GBps": gbs(best(times_load)),
        "backup_s": best(times_backup) if times_backup else None,
        "backup_GBps": gbs(best(times_backup)) if times_backup else None,
        "pinned_h2d_s": best(times_h2d),
        "pinned_h2d_GBps": gbs(best(times_h2d)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pages", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [bench_layout(args, layout) for layout in ("layer_page_first", "page_first")]
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    for r in rows:
        print(f"{name} {r['layout']:>16}: {r['pages']} pages, {r['bytes'] / 2**20:.1f} MiB: load-back "
              f"{r['load_back_GBps']:.2f} GB/s ({r['load_back_s'] * 1e3:.2f} ms), backup "
              f"{(r['backup_GBps'] or 0):.2f} GB/s; pinned H2D copy of the same bytes {r['pinned_h2d_GBps']:.2f} GB/s "
              f"-> load-back at {r['load_back_GBps'] / r['pinned_h2d_GBps']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
