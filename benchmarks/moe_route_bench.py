"""The MoE router's selection (``cpgraph::moe_route``) against the torch formulation it replaced.

DeepSeek-V3.2's router (256 experts in 8 groups, the best 4 groups, top-8; GLM-5's has one group).
Timed in one run on the same sigmoid scores:

* ``ours``: the op's CUDA provider (``cpgraph/kernels/moe_route.py``);
* ``torch``: the three ``topk`` calls with the scatter and the mask between them, eager, as the model
  ran them before (and as transformers does);
* ``inductor``: the same code under ``torch.compile`` (Inductor fuses the pointwise parts; ``topk``
  stays ATen's);
* ``copy``: ``dst.copy_(src)`` of ours' bytes (the ``[M, E]`` fp32 scores read, ids and weights
  written), the roofline.

Before timing, ours is checked against the op's torch reference (ids equal, weights bit-equal) and
against the torch formulation (the same experts and weights where no scores tie).  Reported per case:
median ms, GB/s of ours' bytes over each peer's time, that as a share of the copy rate, and ours'
speedup over each peer.  ``--sweep`` also times rows per program x warps.

    python benchmarks/moe_route_bench.py [--rows 4096 32768 131072] [--sweep] [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/moe_route_bench.py --device cpu --rows 5 --no-compile   # dry run
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_rates import copy_peer, finish, peer_args, rates, setup, time_peers  # noqa: E402

# name -> (experts, n_group, topk_group, top_k, routed scaling)
CASES = {"v32": (256, 8, 4, 8, 2.5), "glm5": (256, 1, 1, 8, 2.5)}
SWEEP = [(4, 2), (8, 2), (8, 4), (16, 4), (16, 8), (32, 8)]  # (rows per program, warps)


def torch_route(scores, bias, n_group, topk_group, top_k, scaling):
    """The model's router selection before the op: three topk calls (transformers' formulation)."""
    m, e = scores.shape
    choice = scores + bias
    group = choice.view(m, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group).scatter(1, group.topk(topk_group, dim=-1, sorted=False).indices, 1.0)
    choice = choice.masked_fill(keep.unsqueeze(-1).expand(-1, n_group, e // n_group).reshape(m, e) == 0,
                                float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    w = scores.gather(1, ids)
    return ids, w / (w.sum(-1, keepdim=True) + 1e-20) * scaling


def traffic(m: int, e: int, top_k: int) -> int:
    """Bytes ours moves: the fp32 scores and the bias read, int64 ids and fp32 weights written."""
    return m * e * 4 + e * 4 + m * top_k * (8 + 4)


def check(ours, theirs, scores, bias, case) -> None:
    from cpgraph.ops.moe_route import moe_route_reference

    e, n_group, topk_group, top_k, scaling = case
    want = moe_route_reference(scores.cpu(), bias.cpu(), n_group, topk_group, top_k, True, scaling)
    if not torch.equal(ours[0].cpu(), want[0]) or not torch.equal(ours[1].cpu().view(torch.int32),
                                                                    want[1].view(torch.int32)):
        raise SystemExit("moe_route_bench: the provider differs from the op's reference")
    same = torch.equal(ours[0].sort(-1).values.cpu(), theirs[0].sort(-1).values.cpu())
    if not same:  # random fp32 scores: a tie at the k-th expert is possible but would be one row in millions
        raise SystemExit("moe_route_bench: the provider chose other experts than the torch formulation")


def main(argv=None) -> dict:
    args = peer_args(__doc__.split("\n", 1)[0], list(CASES), "M values (default 4096 32768 131072; CPU: 5)",
                     "also time rows per program x warps").parse_args(argv)

    import cpgraph.ops  # noqa: F401  (registers the ops; the CUDA provider binds on first use)
    from cpgraph.kernels.moe_route import moe_route

    ops = torch.ops.cpgraph
    device, cuda, rows, repeat = setup(args, [4096, 32768, 131072], [5])
    compiled = None if args.no_compile else torch.compile(torch_route, dynamic=False)
    report_cases = []
    for name in args.cases:
        case = CASES[name]
        e, n_group, topk_group, top_k, scaling = case
        for m in rows:
            g = torch.Generator(device=device).manual_seed(m)
            scores = torch.randn(m, e, device=device, generator=g).sigmoid()
            bias = torch.randn(e, device=device, generator=g) / 64
            check(ops.moe_route(scores, bias, n_group, topk_group, top_k, True, scaling),
                  torch_route(scores, bias, n_group, topk_group, top_k, scaling), scores, bias, case)
            nbytes = traffic(m, e, top_k)
            copy, src, dst = copy_peer(nbytes, device)
            peers = {"ours": lambda: ops.moe_route(scores, bias, n_group, topk_group, top_k, True, scaling),
                     "torch": lambda: torch_route(scores, bias, n_group, topk_group, top_k, scaling),
                     "copy": copy}
            if compiled is not None:
                peers["inductor"] = lambda: compiled(scores, bias, n_group, topk_group, top_k, scaling)
            if args.sweep:
                for rpp, warps in SWEEP:
                    peers[f"{rpp} rows {warps}w"] = (lambda r=rpp, w=warps: moe_route(
                        scores, bias, n_group, topk_group, top_k, True, scaling, rows_per_program=r, num_warps=w))
            ms = time_peers(peers, repeat, cuda, args.graph)
            report_cases.append({
                "case": name, "rows": m, "experts": e, "n_group": n_group, "topk_group": topk_group, "top_k": top_k,
                "bytes": nbytes, "copy_gbs": nbytes / ms["copy"] / 1e6, "results": rates(ms, nbytes)})
            del scores, src, dst

    return finish(args, "moe_route", report_cases, [("case", 5), ("rows", 7)], repeat=repeat)


if __name__ == "__main__":
    main()
