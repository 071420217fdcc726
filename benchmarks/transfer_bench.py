"""Loopback Mooncake throughput (our sender vs the raw engine, same bytes, same run) and per-layer overlap share.

    python benchmarks/transfer_bench.py [--pages 2048] [--layers 8] [--repeat 3]

1. Throughput: a synthetic KV pool (``--layers`` layers of ``--pages`` pages)
   is sent once by :class:`KVSender` (owned-page runs, byte-capped batches)
   and once by a raw ``batch_transfer_sync_write`` of the same (src, dst,
   len) blocks, alternating, best of ``--repeat``.  Goal: ours >= 90 % of raw.
2. Overlap: the tiny GLM-5 model prefills a batch eagerly on CPU with layer
   hooks; the share of transfer hidden behind the forward is
   ``1 - tail_per_layer / tail_sequential`` (tail = forward end -> last byte).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def throughput(pages: int, layers: int, repeat: int, max_batch: int) -> dict:
    from cpgraph.runtime.kv_pool import KVPool, KVPoolConfig
    from cpgraph.transfer import DecodeSide, PrefillPeer

    cfg = KVPoolConfig(num_layers=layers, page_size=64, num_pages=pages, kv_lora_rank=512, qk_rope_dim=64,
                       index_head_dim=128, index_layers=list(range(0, layers, 2)), dtype=torch.bfloat16)
    src_pool, dst_pool = KVPool(cfg), KVPool(cfg)
    for t in src_pool.mla + list(src_pool.index_k.values()):
        t.view(torch.uint8).random_(0, 255)
    peer = PrefillPeer(src_pool, 0, max_batch_bytes=max_batch)
    dec = DecodeSide(dst_pool)
    table = src_pool.alloc_pages_with_owners([0] * pages)
    dec.open_room(0, pages * 64 - 1, [peer.address])
    plan = peer.sender.plan(peer.targets[0], table, 0, pages, last=False)
    batches = peer.sender.layer_batches(plan, range(layers))
    nbytes = sum(sum(b[2]) for b in batches)
    ours, raw = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        assert peer.sender.send_layers(plan, range(layers)) == 0
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for s, d, n in batches:  # the raw engine, same blocks
            assert peer.engine._engine.batch_transfer_sync_write(dec.engine.session_id, s, d, n) == 0
        raw.append(time.perf_counter() - t0)
    ok = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
             for a, b in zip(src_pool.mla + list(src_pool.index_k.values()), dst_pool.mla + list(dst_pool.index_k.values())))
    peer.close(), dec.close()
    return {"bytes": nbytes, "ours_gbps": nbytes / min(ours) / 1e9, "raw_gbps": nbytes / min(raw) / 1e9,
            "ratio": min(raw) / min(ours), "bytes_identical": ok, "batches": len(batches)}


def overlap(lens, group: int, repeat: int) -> dict:
    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import make_layout
    from cpgraph.runtime.engine import pool_config
    from cpgraph.runtime.kv_pool import KVPool
    from cpgraph.transfer import DecodeSide, PrefillPeer, attach_layer_hooks, make_pool, prefill_and_send

    model = from_pretrained("tiny-glm5").eval()
    layout = make_layout(model, "bf16", 16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in lens]
    tails = {False: [], True: []}
    fwd_s = []
    for rep in range(repeat):
        for ov in (False, True):
            pool = make_pool(model, prompts, page_size=16)
            peer = PrefillPeer(pool, 0, group=group)
            dec = DecodeSide(KVPool(pool_config(model, "bf16", 16, sum(n // 16 + 2 for n in lens), 0)),
                             max_rooms=len(lens))
            for r, p in enumerate(prompts):
                dec.open_room(r, len(p), [peer.address])
            hooks = attach_layer_hooks(model, peer.manager, pool) if ov else []
            end = [0.0]

            def fwd(ids, meta, mla, index):
                out = model(ids, meta, mla, index, layout)
                end[0] = time.perf_counter()
                return out
            res = prefill_and_send(fwd, model, prompts, page_size=16, pool=pool, peer=peer,
                                   rooms=list(range(len(lens))), overlap=ov)
            tails[ov].append(time.perf_counter() - end[0])
            fwd_s.append(res.forward_seconds)
            assert all(s == 4 for s in res.statuses.values())
            for h in hooks:
                h.remove()
            peer.close(), dec.close()
    seq, ovl = float(np.median(tails[False])), float(np.median(tails[True]))
    return {"tail_sequential_ms": seq * 1e3, "tail_per_layer_ms": ovl * 1e3, "forward_ms": float(np.median(fwd_s)) * 1e3,
            "hidden_share": max(0.0, 1 - ovl / seq)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-batch-mb", type=int, default=32)
    ap.add_argument("--group", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    tp = throughput(a.pages, a.layers, a.repeat, a.max_batch_mb << 20)
    print(f"throughput: {tp['bytes'] / 2**20:.0f} MiB in {tp['batches']} batches: sender {tp['ours_gbps']:.3f} GB/s, "
          f"raw TransferEngine {tp['raw_gbps']:.3f} GB/s -> {100 * tp['ratio']:.1f}% of raw (goal >= 90%); "
          f"bytes identical: {tp['bytes_identical']}")
    ov = overlap([512, 384, 256], a.group, a.repeat)
    print(f"overlap (CPU eager, tiny GLM-5, 3 prompts): forward {ov['forward_ms']:.1f} ms; transfer tail after the "
          f"forward {ov['tail_sequential_ms']:.2f} ms sequential -> {ov['tail_per_layer_ms']:.2f} ms per-layer: "
          f"{100 * ov['hidden_share']:.1f}% hidden")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"throughput": tp, "overlap": ov}, f, indent=1)


if __name__ == "__main__":
    main()
