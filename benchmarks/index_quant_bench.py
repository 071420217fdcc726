"""FP8 indexer operand preparation: the Triton kernels of ``cpgraph/kernels/index_quant.py`` vs the torch references.

With FP8 KV the indexer runs, per layer, ``hadamard`` and ``index_k_quant`` on k ``[M, 128]`` and
``indexer_q_prepare`` on q ``[M, 64, 128]`` (``cpgraph/models/indexer.py``), the fused form of
``hadamard`` + ``indexer_q_quant`` on q, which are timed too.  The op
bodies run the torch references as eager kernel chains, which Inductor cannot fuse into, so the
reference times below are what a compiled forward spends on them without the providers.

Per op and for the layer's three calls together (``layer``): median ms of the Triton provider and
of the reference, the reference / Triton ratio, the bytes the op must move (every input byte read
once, every output byte written once: the formula is in ``BYTES``) over the Triton time in GB/s,
and that rate as a share of the same run's device copy rate (``x.clone()`` of 1 GiB, read +
written) and of the H200's nominal 4.3 TB/s.  Every Triton result is checked byte for byte against
the reference first (NaN codes compared as one value; random inputs have none).

Default: DeepSeek-V3.2's indexer at M = 32768 tokens (64 heads x 128, bf16).  ``--sweep`` also
times each op at several tiles (values per program, warps) and prints the best, to set
``index_quant.TILES``.  ``--device cpu`` (with ``TRITON_INTERPRET=1``) is a dry run at tiny sizes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

NOMINAL_COPY_GBS = 4300.0  # H200 HBM3e copy rate this project measures against (4.24 TB/s measured)
SWEEP = [(1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 8)]


def BYTES(op: str, m: int, heads: int, dim: int, elem: int) -> int:
    """Bytes an op must move at ``m`` tokens (``elem`` = bytes per input value)."""
    q, k = m * heads * dim, m * dim
    if op == "hadamard_q":
        return 2 * q * elem
    if op == "hadamard_k":
        return 2 * k * elem
    if op == "index_k_quant":
        return k * elem + k + 4 * m  # keys in; e4m3 bytes + one fp32 scale per token out
    if op in ("indexer_q_quant", "indexer_q_prepare"):  # prepare reads q unrotated, quant reads it rotated
        return q * elem + 4 * m * heads + q + 4 * m * heads  # q and weights in; bytes and folded weights out
    raise KeyError(op)


# The ops a forward with FP8 KV runs per layer (the queries' pair fused into indexer_q_prepare).
FORWARD_OPS = ("hadamard_k", "index_k_quant", "indexer_q_prepare")


def _time_ms(fn, repeat: int, device: torch.device) -> float:
    for _ in range(3):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(repeat):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    else:
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _same(got, want) -> bool:
    if isinstance(got, tuple):
        return all(_same(a, b) for a, b in zip(got, want))
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if got.dtype == torch.uint8:
        nan = lambda t: torch.where((t & 0x7F) == 0x7F, 0x7F, t)  # noqa: E731
        return torch.equal(nan(got), nan(want))
    bits = {2: torch.int16, 4: torch.int32}[got.element_size()]
    return bool(((torch.isnan(got) & torch.isnan(want)) | (got.view(bits) == want.view(bits))).all())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=None, help="M (default 32768 on CUDA, 64 on CPU)")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--sweep", action="store_true", help="also time each op at the tiles in SWEEP")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from cpgraph.kernels import index_quant as iq
    from cpgraph.ops.codecs import index_k_quant_reference
    from cpgraph.ops.indexer import hadamard_reference, indexer_q_quant_reference

    device = torch.device(args.device)
    cpu = device.type == "cpu"
    dtype = getattr(torch, args.dtype)
    m = args.tokens or (64 if cpu else 32768)
    repeat = args.repeat or (3 if cpu else 20)
    H, D, elem = args.heads, args.dim, dtype.itemsize

    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(m, H, D, device=device, generator=g).to(dtype)
    k = torch.randn(m, D, device=device, generator=g).to(dtype)
    w = torch.randn(m, H, device=device, generator=g) * 0.01
    qh, kh = hadamard_reference(q), hadamard_reference(k)

    # name -> (Triton provider taking an optional tile, reference)
    cases = {
        "hadamard_q": (lambda tile=None: iq.hadamard(q, tile), lambda: hadamard_reference(q)),
        "hadamard_k": (lambda tile=None: iq.hadamard(k, tile), lambda: hadamard_reference(k)),
        "index_k_quant": (lambda tile=None: iq.index_k_quant(kh, tile), lambda: index_k_quant_reference(kh)),
        "indexer_q_quant": (lambda tile=None: iq.indexer_q_quant(qh, w, tile),
                            lambda: indexer_q_quant_reference(qh, w)),
        "indexer_q_prepare": (lambda tile=None: iq.indexer_q_prepare(q, w, tile),
                              lambda: indexer_q_quant_reference(qh, w)),
    }

    copy_gbs = None
    if not cpu:
        buf = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
        copy_gbs = 2 * buf.numel() * 2 / _time_ms(lambda: buf.clone(), repeat, device) / 1e6
        del buf

    def rate(nbytes: int, ms: float) -> dict:
        gbs = nbytes / ms / 1e6
        return {"gbs": gbs, "of_copy": gbs / copy_gbs if copy_gbs else None, "of_nominal": gbs / NOMINAL_COPY_GBS}

    rows = []
    for name, (tri, ref) in cases.items():
        ok = _same(tri(), ref())
        row = {"op": name, "bytes": BYTES(name, m, H, D, elem), "exact": ok,
               "triton_ms": _time_ms(tri, repeat, device), "reference_ms": _time_ms(ref, repeat, device)}
        row.update(rate(row["bytes"], row["triton_ms"]))
        if args.sweep and not cpu:
            sweep = {f"{v}x{wp}": _time_ms(lambda v=v, wp=wp: tri((v, wp)), repeat, device) for v, wp in SWEEP}
            row["sweep_ms"] = sweep
            row["best_tile"] = min(sweep, key=sweep.get)
        rows.append(row)
    fwd = [r for r in rows if r["op"] in FORWARD_OPS]
    layer = {"op": "layer", "bytes": sum(r["bytes"] for r in fwd), "exact": all(r["exact"] for r in rows),
             "triton_ms": sum(r["triton_ms"] for r in fwd), "reference_ms": sum(r["reference_ms"] for r in fwd)}
    layer.update(rate(layer["bytes"], layer["triton_ms"]))
    by = {r["op"]: r for r in rows}
    pair_ms = by["hadamard_q"]["triton_ms"] + by["indexer_q_quant"]["triton_ms"]
    layer["q_pair_separate_ms"], layer["q_pair_fused_ms"] = pair_ms, by["indexer_q_prepare"]["triton_ms"]
    rows.append(layer)

    print(f"M={m} H={H} D={D} {args.dtype} on {torch.cuda.get_device_name(device) if not cpu else 'cpu'}"
          + (f"; copy {copy_gbs:.0f} GB/s" if copy_gbs else ""))
    print(f"{'op':>16} {'MB':>8} {'triton ms':>10} {'ref ms':>9} {'ref/tri':>8} {'GB/s':>7} {'%copy':>6} "
          f"{'%4.3TB/s':>8} exact")
    for r in rows:
        of_copy = f"{100 * r['of_copy']:.0f}" if r["of_copy"] else "-"
        print(f"{r['op']:>16} {r['bytes'] / 1e6:8.1f} {r['triton_ms']:10.3f} {r['reference_ms']:9.3f} "
              f"{r['reference_ms'] / r['triton_ms']:8.1f} {r['gbs']:7.0f} {of_copy:>6} {100 * r['of_nominal']:8.0f} "
              f"{r['exact']}" + (f"  best tile {r['best_tile']} {r['sweep_ms']}" if "sweep_ms" in r else ""))
    print(f"queries: hadamard + indexer_q_quant {layer['q_pair_separate_ms']:.3f} ms, indexer_q_prepare "
          f"{layer['q_pair_fused_ms']:.3f} ms ({layer['q_pair_separate_ms'] / layer['q_pair_fused_ms']:.2f}x); "
          f"'layer' = the ops a forward runs: {', '.join(FORWARD_OPS)}")
    if not all(r["exact"] for r in rows):
        raise SystemExit("a Triton result differs from its reference")
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens": m, "heads": H, "dim": D, "dtype": args.dtype,
                                               "tiles": {k: list(v) for k, v in iq.TILES.items()},
                                               "copy_gbs": copy_gbs, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
