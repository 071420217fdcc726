"""Top-k selection at production shape: cpgraph's tie-rule select kernel vs torch.topk and the HBM read limit.

One request of ``S`` new tokens (default 32K), causal windows (row ``i`` sees keys ``[0, i]``),
``k = 2048`` (DeepSeek-V3.2's ``index_topk``): the scores of one layer's indexer are an fp32
``[S, S]`` matrix whose lower triangle is live.  Two score kinds, both in one run:

* ``indexer``: the real scorer's output (``cpgraph.kernels.indexer_score``) on random bf16
  ``q [S, 64, 128]``, ``k [S, 128]`` and fp32 head weights, the distribution selection meets in
  the model;
* ``randn``: Gaussian scores (few ties);
* ``zeros``: mostly exact zeros (ReLU of negative dots), the tie-heavy case.

Reported per kind: ms for all ``S`` rows of our kernel (each tuning variant), ``torch.topk`` over
the window-masked rows (the peer: not exact under the tie rule, no position order), and the
read limit: the live scores' bytes at the same run's measured HBM read rate (``x.amax`` over a
large buffer).  A correctness check compares a few hundred rows with the torch reference
(``topk_ragged_reference``) for every kind.  ``--json`` writes every figure.

    python benchmarks/topk_select_bench.py [--tokens 32768] [--sweep] [--stages] [--json out.json]
        [--write-tuning tuning.json]

``--stages`` times the default and the fastest variant cut after each stage (sample and bracket,
window pass, refinement); ``--write-tuning`` writes the fastest exact variant as a
``CPGRAPH_INDEXER_TUNING`` file, so a later run (``production_shape.py``) can use it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOPK = 2048
# (block, warps, sample, maxnreg, stages, compact, prefetch, float_pass, list_step) variants of --sweep, fields in
# the order of TUNING_NAMES; the first is the default tuning.  Fewer warps a program: no cross-warp barriers in the
# block scans and more resident row programs.  ``prefetch``: the window pass loads the next block before it scans
# this one.  ``float_pass``: the window pass compares fp32 scores in 32 x warps-key steps (kernels/topk_select.py,
# ``_float_pass``).  ``list_step``: the refinement's histogram passes and the collection walk the list in 32 x
# warps-entry steps, one entry a thread (``_list_hist``, ``_collect_list``).
SWEEP = [(128, 1, 512, 0, 0, True, False, True, True), (512, 4, 512, 0, 0, False, False, False, False),
         (128, 1, 512, 0, 0, True, False, True, False), (128, 1, 512, 0, 0, False, False, True, False),
         (256, 1, 512, 0, 0, True, False, True, False), (64, 1, 512, 0, 0, True, False, True, False),
         (128, 1, 256, 0, 0, True, False, True, False), (128, 2, 512, 0, 0, True, False, True, False),
         (128, 1, 512, 48, 0, True, False, True, False), (512, 4, 512, 0, 0, True, False, True, False),
         (128, 1, 512, 0, 0, True, True, False, True), (128, 1, 512, 0, 0, True, True, False, False),
         (128, 1, 512, 0, 0, False, True, False, True), (128, 2, 512, 0, 0, True, False, True, True)]
# The tuning parameter of each field of a variant (--write-tuning writes the fastest exact variant under these).
TUNING_NAMES = ("SELECT_BLOCK", "SELECT_WARPS", "SELECT_SAMPLE", "SELECT_MAXNREG", "SELECT_STAGES", "SELECT_COMPACT",
                "SELECT_PREFETCH", "SELECT_FLOAT_PASS", "SELECT_LIST_STEP")
# Stage cuts (--stages): the kernel ends each row after the sample's bracket (1), the window pass (2)
# or the refinement (3); differences of these times place the time inside the kernel.
STAGES = {1: "sample + bracket", 2: "+ window pass", 3: "+ refinement"}


def time_ms(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def read_rate_gbs():
    x = torch.empty(1 << 30, dtype=torch.float32, device="cuda").normal_()
    ms = time_ms(lambda: x.amax())
    del x
    return 4 * (1 << 30) / ms / 1e6


def kernel_resources(kernel):
    """Registers, spills and shared bytes of a launched Triton kernel (they bound the resident programs per SM)."""
    if kernel is None:
        return {}
    return {"registers": getattr(kernel, "n_regs", None), "spills": getattr(kernel, "n_spills", None),
            "shared": getattr(getattr(kernel, "metadata", None), "shared", None)}


def make_scores(kind, S, g):
    from cpgraph.kernels.indexer_score import score_rows

    ks = torch.zeros(S, dtype=torch.int64, device="cuda")
    ke = torch.arange(1, S + 1, dtype=torch.int64, device="cuda")
    buf = torch.full((S, S), float("-inf"), dtype=torch.float32, device="cuda")
    if kind == "randn":
        buf.normal_(generator=g)
    else:
        H, D = 64, 128
        q = torch.randn((S, H, D), device="cuda", generator=g).bfloat16()
        k = torch.randn((S, D), device="cuda", generator=g).bfloat16()
        if kind == "zeros":  # most dots negative: exact-zero scores
            q = (q.float() - 2.0).bfloat16()
            k = k.abs()
        w = torch.randn((S, H), device="cuda", generator=g) * (H ** -0.5 * D ** -0.5)
        rows = 4096
        for a in range(0, S, rows):
            m = min(rows, S - a)
            score_rows(q, k, w, ks, ke, buf[a:], a, m)
        del q, k, w
    return buf, ks, ke


def check(buf, ks, ke, out, S):
    from cpgraph.ops.indexer import topk_ragged_reference

    bad = 0
    for a in (TOPK - 64, S // 4, S // 2, S - 256):
        rows = slice(a, a + 128)
        want = topk_ragged_reference(buf[rows], ks[rows], ke[rows], TOPK)
        bad += int((out[rows] != want).any(dim=1).sum())  # sync-ok (benchmark)
    return bad


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--kinds", default="indexer,randn,zeros")
    ap.add_argument("--sweep", action="store_true",
                    help="time every tuning variant on the first kind (the others: the default and the best)")
    ap.add_argument("--chunk-rows", type=int, default=4096, help="rows per launch of the chunked comparison")
    ap.add_argument("--stages", action="store_true",
                    help="also time the stage cuts of the default and the fastest variant (where the time goes)")
    ap.add_argument("--json", default="")
    ap.add_argument("--write-tuning", default="",
                    help="write the first kind's fastest exact variant as a CPGRAPH_INDEXER_TUNING file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("topk_select_bench: needs a CUDA device", file=sys.stderr)
        return 2
    from cpgraph.kernels import indexer as ki
    from cpgraph.kernels.topk_select import scratch_columns

    S = args.tokens
    rate = read_rate_gbs()
    live_bytes = 4 * S * (S + 1) / 2
    limit_ms = live_bytes / rate / 1e6
    print(f"{torch.cuda.get_device_name()}: S={S} k={TOPK}; HBM read {rate:.0f} GB/s; "
          f"live scores {live_bytes / 1e9:.2f} GB -> read limit {limit_ms:.3f} ms", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    results = {"tokens": S, "topk": TOPK, "read_gbs": rate, "read_limit_ms": limit_ms, "kinds": {}}
    for kind in args.kinds.split(","):
        buf, ks, ke = make_scores(kind, S, g)
        out = torch.empty((S, TOPK), dtype=torch.int32, device="cuda")
        scratch = torch.empty((S, scratch_columns(S, TOPK)), dtype=torch.int32, device="cuda")
        row = {"variants": []}
        variants = SWEEP if args.sweep and not results["kinds"] else SWEEP[:1]
        if args.sweep and results["kinds"]:
            first = next(iter(results["kinds"].values()))
            if first.get("best") and tuple(first["best"]["variant"]) != SWEEP[0]:
                variants = [SWEEP[0], tuple(first["best"]["variant"])]
        def launch(v, stop=0):
            block, warps, sample, maxnreg, stages, compact, prefetch, float_pass, list_step = v
            return ki.select_rows(buf, ks, ke, out, 0, S, TOPK, scratch=scratch, block=block, num_warps=warps,
                                  sample=sample, maxnreg=maxnreg, num_stages=stages or None, compact=compact,
                                  prefetch=prefetch, float_pass=float_pass, list_step=list_step, stop_after=stop)

        for v in variants:
            launched = {}
            try:
                ms = time_ms(lambda: launched.update(k=launch(v)))
            except Exception as exc:  # a variant that does not compile is reported, not fatal
                print(f"  {kind} {v}: failed: {str(exc)[:300]}", flush=True)
                continue
            bad = check(buf, ks, ke, out, S)
            res = {"variant": list(v), "ms": ms, "wrong_rows": bad, **kernel_resources(launched.get("k"))}
            row["variants"].append(res)
            print(f"  {kind} select {v}: {ms:.3f} ms ({limit_ms / ms:.2f} of the read limit), wrong rows {bad}; "
                  f"{res.get('registers')} registers, {res.get('spills')} spills, {res.get('shared')} B shared",
                  flush=True)
        fastest = min(row["variants"], key=lambda r: r["ms"]) if row["variants"] else None
        if args.stages and fastest:
            for res in {id(r): r for r in (row["variants"][0], fastest)}.values():
                v = tuple(res["variant"])
                cuts = {n: time_ms(lambda n=n: launch(v, n)) for n in STAGES}
                res["stage_ms"] = cuts
                prev, parts = 0.0, []
                for n, label in STAGES.items():
                    parts.append(f"{label} {cuts[n]:.3f} (+{cuts[n] - prev:.3f})")
                    prev = cuts[n]
                parts.append(f"+ collection {res['ms']:.3f} (+{res['ms'] - prev:.3f})")
                print(f"    stages {v}: " + "; ".join(parts), flush=True)
            launch(tuple(row["variants"][0]["variant"]))  # the stage cuts left wrong ids behind
        # Launch order and chunking, default variant: the forward selects ``--chunk-rows`` rows per
        # launch (its score budget); each launch can end on a wave of its longest rows.
        from cpgraph.kernels import indexer_tuning
        keep = indexer_tuning.get("SELECT_LAST_ROW_FIRST")
        row["order"] = []
        for last_first in (False, True):
            indexer_tuning.set_tuning(SELECT_LAST_ROW_FIRST=last_first)
            for chunk in (S, args.chunk_rows):
                def chunked(chunk=chunk):
                    for a in range(0, S, chunk):
                        m = min(chunk, S - a)
                        ki.select_rows(buf[a:a + m], ks, ke, out, a, m, TOPK, scratch=scratch)
                ms = time_ms(chunked)
                bad = check(buf, ks, ke, out, S)
                row["order"].append({"last_row_first": last_first, "chunk_rows": chunk, "ms": ms, "wrong_rows": bad})
                print(f"  {kind} select default, last row first {last_first}, {chunk} rows a launch: {ms:.3f} ms, "
                      f"wrong rows {bad}", flush=True)
        indexer_tuning.set_tuning(SELECT_LAST_ROW_FIRST=keep)
        topk_ms = time_ms(lambda: buf.topk(TOPK, dim=1))
        row["torch_topk_ms"] = topk_ms
        best = min(row["variants"], key=lambda r: r["ms"]) if row["variants"] else None
        if best:
            row["best"] = best
            print(f"  {kind}: best {best['variant']} {best['ms']:.3f} ms; torch.topk {topk_ms:.3f} ms "
                  f"({topk_ms / best['ms']:.2f}x ours); read limit {limit_ms:.3f} ms", flush=True)
        results["kinds"][kind] = row
        del buf, out, scratch
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.write_tuning and results["kinds"]:
        first = next(iter(results["kinds"].values()))
        exact = [r for r in first["variants"] if r["wrong_rows"] == 0]
        if exact:
            tuning = write_tuning(args.write_tuning, min(exact, key=lambda r: r["ms"])["variant"])
            print(f"tuning written to {args.write_tuning}: {tuning}", flush=True)
    return 0


def variant_tuning(variant) -> dict:
    """A --sweep variant as tuning parameters (``set_tuning`` / ``CPGRAPH_INDEXER_TUNING`` names)."""
    if len(variant) != len(TUNING_NAMES):
        raise ValueError(f"topk_select_bench: a variant has {len(TUNING_NAMES)} fields, got {variant!r}")
    return dict(zip(TUNING_NAMES, variant))


def write_tuning(path, variant) -> dict:
    """Write ``variant`` as a ``CPGRAPH_INDEXER_TUNING`` file; returns what was written."""
    tuning = variant_tuning(variant)
    Path(path).write_text(json.dumps(tuning))
    return tuning


if __name__ == "__main__":
    sys.exit(main())
