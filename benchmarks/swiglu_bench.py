"""The routed experts' SwiGLU kernel (``cpgraph/kernels/swiglu.py``) against eager, Inductor and the copy rate.

Between the two bf16 grouped GEMMs of ``moe_experts_grouped`` the routed rows' ``h [C, 2I]``
(gate | up) becomes ``silu(gate) * up [C, I]``.  This times, in one run and on the same rows:

* ``ours``: the Triton kernel, which reads the routed count ``group_ends[-1]`` on the device and
  stops there (rows past it are never read by the down GEMM);
* ``eager``: ``F.silu(gate) * up`` over the routed rows (two elementwise kernels and a bf16
  ``silu`` temporary), the form the op ran before the kernel -- there over all ``C`` rows, here
  over the routed ones only, so the ratio is the kernel's fusion alone and not its early stop;
* ``compiled``: ``torch.compile`` of that expression (Inductor's fused pointwise kernel, one read
  of gate and up and one write: the strongest peer; the op itself is opaque to Inductor, which is
  why the model needs the kernel);
* ``copy``: ``dst.copy_(src)`` of the same bytes (``3 * routed * I`` values: gate and up read,
  the product written), the roofline this kernel can at best reach.

Reported per routed count: median ms, GB/s (bytes read + written over the time), that rate as a
share of the same run's copy rate, and ours' speedup over each peer.  Before timing, our output
is compared with the eager peer's bits on the routed rows: the kernel rounds as the eager form
does (``silu`` rounded to bf16, then the product), so it may differ only where the two ``exp``
implementations do -- the run fails if more than 1 % of the values differ or any by more than
2 bf16 ulps (one flipped rounding of ``silu`` moves the product by at most that).  The compiled
peer's share of bit-equal values is reported too (Inductor may keep ``silu`` in fp32).

Default: DeepSeek-V3.2's routed experts at 32K tokens, ``C = 32768 * 8`` capacity rows,
``I = 2048``, bf16, 256 experts; routed = all rows and half of them (padded batches route fewer
rows than their capacity).

    python benchmarks/swiglu_bench.py [--routed 1.0 0.5] [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/swiglu_bench.py --device cpu    # dry run at tiny sizes
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from invariant_gemm_bench import _time_ms  # noqa: E402  (CUDA events on a GPU, perf_counter on CPU; median)
from peer_rates import rates  # noqa: E402

MAX_ULPS = 2  # one flipped rounding of the bf16 silu moves the rounded product by at most this
MIN_EXACT = 0.99  # the kernel tests' bound on the share of bit-equal values (tests/kernels/test_swiglu.py)


def eager_swiglu(h: torch.Tensor) -> torch.Tensor:
    """The eager form the kernel replaces: ``F.silu(gate) * up`` of ``h [R, 2I]``."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """16-bit floats as integers whose difference counts ulps (sign-magnitude -> two's complement order)."""
    i = t.view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i & 0x7FFF), i)


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Share of bit-equal values and the largest distance in ulps (16-bit dtypes; fp32: bit-equal share only)."""
    if got.numel() == 0:
        return {"exact_share": 1.0, "max_ulps": 0}
    if got.element_size() == 2:
        same = got.view(torch.int16) == want.view(torch.int16)
        ulps = int((_ordered(got) - _ordered(want)).abs().max().item())
    else:
        same = got.view(torch.int32) == want.view(torch.int32)
        ulps = None
    return {"exact_share": same.float().mean().item(), "max_ulps": ulps}


def group_ends_for(routed: int, experts: int, device) -> torch.Tensor:
    """Cumulative routed rows per expert, evenly spread (int32, as ``dispatch_plan`` makes them)."""
    return ((torch.arange(1, experts + 1, dtype=torch.int64) * routed) // experts).to(torch.int32).to(device)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=None, help="capacity rows C (default 32768 * 8 on CUDA, 40 on CPU)")
    ap.add_argument("--inter", type=int, default=None, help="I (default 2048 on CUDA, 96 on CPU)")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--routed", type=float, nargs="+", default=[1.0, 0.5], help="routed rows as shares of C")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    from cpgraph.kernels.swiglu import swiglu

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    C = args.rows or (32768 * 8 if cuda else 40)
    I = args.inter or (2048 if cuda else 96)  # noqa: E741
    repeat = args.repeat or (20 if cuda else 2)
    elem = dtype.itemsize

    g = torch.Generator(device=device).manual_seed(0)
    h = (torch.randn(C, 2 * I, device=device, generator=g) * 3).to(dtype)
    compiled = None if args.no_compile else torch.compile(eager_swiglu, dynamic=False)

    cases = []
    for share in args.routed:
        routed = max(0, min(C, round(share * C)))
        group_ends = group_ends_for(routed, args.experts, device)
        hr = h[:routed]
        nbytes = 3 * routed * I * elem  # gate and up read, the product written
        src = h.view(-1)[: nbytes // (2 * elem)]  # half the bytes read, half written: the same traffic
        dst = torch.empty_like(src)

        ours_out = swiglu(h, group_ends)[:routed]
        want = eager_swiglu(hr)
        check = compare(ours_out, want)
        case = {"capacity_rows": C, "routed_rows": routed, "inter": I, "bytes": nbytes, "ours_vs_eager": check}
        peers = {"ours": lambda: swiglu(h, group_ends), "eager": lambda: eager_swiglu(hr),
                 "copy": lambda: dst.copy_(src)}
        if compiled is not None:
            case["compiled_vs_eager"] = compare(compiled(hr), want)
            peers["compiled"] = lambda: compiled(hr)
        del ours_out, want
        ms = {name: _time_ms(fn, repeat, cuda) for name, fn in peers.items()}
        case["copy_gbs"] = nbytes / ms["copy"] / 1e6
        case["results"] = rates(ms, nbytes)
        cases.append(case)
        del src, dst

    where = torch.cuda.get_device_name(device) if cuda else "cpu (dry run: the times mean nothing)"
    print(f"SwiGLU C={C} I={I} {args.dtype}, {args.experts} experts, on {where}")
    print(f"{'routed':>8} {'peer':>9} {'ms':>9} {'GB/s':>8} {'%copy':>6} {'ours x':>7}")
    for case in cases:
        for name, r in case["results"].items():
            print(f"{case['routed_rows']:>8} {name:>9} {r['ms']:9.3f} {r['gbs']:8.0f} {100 * r['of_copy']:6.0f} "
                  f"{r['ours_speedup']:7.2f}")
        c = case["ours_vs_eager"]
        line = f"{'':>8} ours vs eager: {100 * c['exact_share']:.3f}% bit-equal, max {c['max_ulps']} ulp"
        if "compiled_vs_eager" in case:
            line += f"; compiled vs eager: {100 * case['compiled_vs_eager']['exact_share']:.3f}% bit-equal"
        print(line)
    report = {"device": where, "dtype": args.dtype, "experts": args.experts, "repeat": repeat, "cases": cases}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    for case in cases:
        c = case["ours_vs_eager"]
        if c["exact_share"] < MIN_EXACT or (c["max_ulps"] is not None and c["max_ulps"] > MAX_ULPS):
            raise SystemExit(f"ours differs from the eager form at {case['routed_rows']} routed rows: {c}")
    return report


if __name__ == "__main__":
    main()
