"""A memory-bound kernel and its peers timed in one run: ms, GB/s of ours' bytes, share of the copy rate, speedup.

Shared by the benchmarks of the row-local kernels (``norm_quant_bench``, ``moe_route_bench``,
``swiglu_bench``): each times ``ours``, its peers and ``copy`` (``dst.copy_(src)`` of ours' bytes, the
roofline) and reports every peer against the same byte count, so the columns mean the same in each.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def peer_args(description: str, cases: list[str], rows_help: str, sweep_help: str,
              compile_help: str = "skip the Inductor peer") -> argparse.ArgumentParser:
    """The options every such benchmark takes (``--device --rows --cases --repeat --sweep --no-compile --json``)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, nargs="+", default=None, help=rows_help)
    ap.add_argument("--cases", nargs="+", default=list(cases), choices=list(cases))
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--sweep", action="store_true", help=sweep_help)
    ap.add_argument("--no-compile", action="store_true", help=compile_help)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--graph", action="store_true",
                    help="time CUDA-graph replays (device time only: a few-row call's host work drops out)")
    return ap


def setup(args, cuda_rows: list[int], cpu_rows: list[int]) -> tuple:
    """``(device, cuda, rows, repeat)`` from the parsed options: 20 timed calls on a GPU, 1 in a CPU dry run."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    return device, cuda, args.rows or (cuda_rows if cuda else cpu_rows), args.repeat or (20 if cuda else 1)


def time_peers(peers: dict, repeat: int, cuda: bool, graph: bool = False) -> dict[str, float]:
    """Median ms of each peer.  Eager calls are timed with CUDA events around each call, which includes the
    host's launch work whenever it exceeds the kernels' time (a Python wrapper at 4096 rows can); with
    ``graph`` (GPU only) each peer is captured once, ``GRAPH_CALLS`` calls in one CUDA graph, and a replay's
    time over the calls is what is reported: the device time a captured forward pays."""
    from invariant_gemm_bench import _time_ms

    if not (graph and cuda):
        return {p: _time_ms(fn, repeat, cuda) for p, fn in peers.items()}
    out = {}
    for name, fn in peers.items():
        fn()  # compile / autotune / first-use binding outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(GRAPH_CALLS):
                fn()
        out[name] = _time_ms(g.replay, repeat, cuda) / GRAPH_CALLS
        del g
    return out


GRAPH_CALLS = 10  # calls per captured graph: a replay's launch cost spread over them


def copy_peer(nbytes: int, device) -> tuple:
    """``(fn, src, dst)``: a copy of ``nbytes`` (half read, half written); keep ``src``/``dst`` alive while timing."""
    src = torch.empty(max(1, nbytes // 4), dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), src, dst


def rates(ms: dict[str, float], nbytes: int) -> dict:
    """Per peer: ``ms``, ``gbs`` (ours' bytes over its time), ``of_copy`` and ``ours_speedup`` (needs ``ours``, ``copy``)."""
    return {p: {"ms": t, "gbs": nbytes / t / 1e6, "of_copy": ms["copy"] / t, "ours_speedup": t / ms["ours"]}
            for p, t in ms.items()}


def finish(args, op: str, cases: list[dict], keys: list[tuple[str, int]], peer_width: int = 14, **extra) -> dict:
    """Print the table under a header naming the provider of ``op`` that ran as ``ours`` and the device; write
    ``--json``; return the report."""
    from cpgraph.ops.providers import active_provider

    device = torch.device(args.device)
    provider = active_provider(op, device.type)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run: the times mean nothing)"
    graph = bool(getattr(args, "graph", False)) and device.type == "cuda"
    timing = "CUDA-graph replays" if graph else "eager calls"
    print(f"{op} ({provider}) on {where}, {timing} (bytes: ours' traffic; GB/s of those bytes over each peer's time)")
    print_rates(cases, keys, peer_width)
    report = {"device": where, "provider": provider, "cuda_graph": graph, **extra, "cases": cases}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


def print_rates(cases: list[dict], keys: list[tuple[str, int]], peer_width: int = 14, ms_digits: int = 4) -> None:
    """One line per (case, peer): the case's ``keys`` columns (name, width), then the peer's figures."""
    head = " ".join(f"{k:>{w}}" for k, w in keys)
    print(f"{head} {'peer':>{peer_width}} {'ms':>9} {'GB/s':>8} {'%copy':>6} {'ours x':>7}")
    for c in cases:
        lead = " ".join(f"{c[k]!s:>{w}}" for k, w in keys)
        for p, r in c["results"].items():
            print(f"{lead} {p:>{peer_width}} {r['ms']:9.{ms_digits}f} {r['gbs']:8.0f} {100 * r['of_copy']:6.0f} "
                  f"{r['ours_speedup']:7.2f}")
