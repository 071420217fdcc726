"""The residual add + RMSNorm that quantises its output (``cpgraph::fp8_rms_norm_quantize``) against its peers.

In the FP8 forward, ``fuse_norm_into_quantization`` replaces Inductor's add + norm kernel followed by
``fp8_quantize_activations`` with this one kernel.  Timed in one run, on the same rows:

* ``ours``: the op's CUDA provider (``cpgraph/kernels/norm_quant.py``);
* ``norm+quant``: what the forward ran before the pass: ``torch.compile`` of ``x + res`` and
  ``F.rms_norm`` (Inductor's fused kernel, writing the sum and the bf16 normed rows), then the
  quantiser reading the normed rows back;
* ``norm``: Inductor's add + norm kernel alone, which the bf16 forward runs: ours minus this is what
  the quantisation costs once fused;
* ``copy``: ``dst.copy_(src)`` of ours' bytes (half read, half written), the roofline.

Bytes are ours' traffic: ``x`` (and ``res``) read, the sum (with a residual), the normed rows (when
something else reads them) and the e4m3 codes written, plus the scales.  Reported per case: median ms,
GB/s of those bytes over each peer's time, that as a share of the same run's copy rate, and ours'
speedup over each peer.  Before timing, ours is checked against the op's torch reference: the sum
bit-equal, the normed rows within one ulp, the codes exactly the quantisation of the normed rows.

Cases (DeepSeek-V3.2): the attention input (hidden 7168, residual add, normed rows also read by the
indexer's fp32 weights_proj) and the query latent (1536, no residual, only FP8 projections read it), at
4096 and 32768 rows.  ``--sweep`` also times variants: the row in registers (one sweep) at several warp
counts, and two sweeps of several tiles.

    python benchmarks/norm_quant_bench.py [--rows 4096 32768] [--sweep] [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/norm_quant_bench.py --device cpu --rows 6 --no-compile   # dry run
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_rates import copy_peer, finish, peer_args, rates, setup, time_peers  # noqa: E402

# name -> (K, residual add, normed rows written for another reader)
CASES = {"attn_input": (7168, True, True), "q_latent": (1536, False, False)}
# --sweep variants (row_values, tile_values, warps): the whole row in registers (one sweep) at 4 / 8 / 16 warps,
# and two sweeps of a 512- to 4096-value tile (row_values 0 forces them; no padding where the tile divides the
# row: 7168 = 7 x 1024, 1536 = 3 x 512, where one sweep pads to 8192 and 2048)
SWEEP = [(8192, 2048, 4), (8192, 2048, 8), (8192, 2048, 16), (0, 512, 4), (0, 1024, 4), (0, 1024, 8), (0, 2048, 4),
         (0, 2048, 8), (0, 4096, 8)]


def traffic(m: int, k: int, residual: bool, emit: bool) -> int:
    """Bytes ours moves: bf16 reads and writes, e4m3 codes, fp32 scales (one per 128 values)."""
    reads = (2 if residual else 1) * m * k * 2
    writes = (m * k * 2 if residual else 0) + (m * k * 2 if emit else 0) + m * k + m * -(-k // 128) * 4
    return reads + writes


def check(ours, x, res, w, emit: bool) -> None:
    from cpgraph.ops.fp8_linear import quantize_activations_reference
    from cpgraph.ops.norm_quant import rms_norm_quantize_reference

    want = rms_norm_quantize_reference(x.cpu(), None if res is None else res.cpu(), w.cpu(), 1e-6, 128, True, True)
    summed, normed, q, scales = (t.cpu() for t in ours)
    if res is not None and not torch.equal(summed, want[0]):
        raise SystemExit("norm_quant_bench: the residual sum differs from the reference")
    if emit:
        diff = (normed.double() - want[1].double()).abs() / (want[1].double().abs() * 2**-7).clamp_min(1e-30)
        if float(diff.max()) > 1.0:
            raise SystemExit(f"norm_quant_bench: normed rows {float(diff.max()):.2f} ulps off the reference")
        wq, ws = quantize_activations_reference(normed, 128, True)
        if not (torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(scales, ws)):
            raise SystemExit("norm_quant_bench: the codes are not those of the normed rows")


def main(argv=None) -> dict:
    args = peer_args(__doc__.split("\n", 1)[0], list(CASES), "M values (default 4096 32768; CPU: 6)",
                     "also time the tile variants", "skip the Inductor peers").parse_args(argv)

    import cpgraph.ops  # noqa: F401  (registers the ops; the CUDA provider binds on first use)
    from cpgraph.kernels.norm_quant import rms_norm_quantize

    ops = torch.ops.cpgraph
    device, cuda, rows, repeat = setup(args, [4096, 32768], [6])
    report_cases = []
    for name in args.cases:
        k, residual, emit = CASES[name]
        k = k if cuda else min(k, 384)
        for m in rows:
            g = torch.Generator(device=device).manual_seed(m)
            x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
            res = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16) if residual else None
            w = (torch.rand(k, device=device, generator=g) + 0.5).to(torch.bfloat16)
            check(rms_norm_quantize(x, res, w, 1e-6, 128, True, emit), x, res, w, emit)
            nbytes = traffic(m, k, residual, emit)
            copy, src, dst = copy_peer(nbytes, device)
            peers = {"ours": lambda: ops.fp8_rms_norm_quantize(x, res, w, 1e-6, 128, True, emit), "copy": copy}
            if not args.no_compile:
                @torch.compile(dynamic=False)
                def norm(x, res, w):
                    s = x + res if res is not None else x
                    return s, F.rms_norm(s, (k,), w, 1e-6)

                peers["norm+quant"] = lambda: ops.fp8_quantize_activations(norm(x, res, w)[1], 128, True)
                peers["norm"] = lambda: norm(x, res, w)
            if args.sweep:
                for row_values, tile, warps in SWEEP:
                    label = f"one sweep {warps}w" if row_values else f"two {tile} {warps}w"
                    peers[label] = (lambda rv=row_values, t=tile, nw=warps: rms_norm_quantize(
                        x, res, w, 1e-6, 128, True, emit, row_values=rv, tile_values=t, num_warps=nw))
            ms = time_peers(peers, repeat, cuda, args.graph)
            case = {"case": name, "rows": m, "K": k, "residual": residual, "emit_normed": emit, "bytes": nbytes,
                    "copy_gbs": nbytes / ms["copy"] / 1e6, "results": rates(ms, nbytes)}
            report_cases.append(case)
            del x, res, src, dst

    return finish(args, "fp8_rms_norm_quantize", report_cases, [("case", 11), ("rows", 6)], peer_width=16,
                  repeat=repeat)


if __name__ == "__main__":
    main()
