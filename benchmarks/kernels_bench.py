"""Triton data-movement kernels against the HBM copy limit and the torch references (one GPU).

For every op and production shape (32K and 128K tokens; hidden 7168 bf16 rows
for take_rows / rerange / compaction; 656-byte MLA records and 132-byte
index-K tokens, page 64) it prints one table:

* ``GB/s``: bytes the op must move (each input byte it needs read once, each
  output byte written once, index tensors included) / median time;
* ``%copy``: that rate over ``dst.copy_(src)`` of the same number of bytes,
  measured in the same run (a copy of N bytes moves 2N: read + write);
* ``x ref``: time of the torch reference / time of the Triton provider;
* ``exact``: the provider's output bytes equal the reference's.

Then the rerange measurement.  One GPU, so a local ``copy_`` of the gathered
bytes stands in for the all-gather: time(copy + placement) and
time(folded placement, rows written straight to their final positions from
the per-rank send buffers) against time(copy alone).

Rows marked ``oob`` run the same op with 5% of the ids out of range (below
-1, past the end, 2**40): the kernels mask every load and store by the
index range, so these rows must be exact and as fast as their in-range
twins.  What the masking costs is shown by ``--compare``: run the benchmark
of the commit before the masking with ``--out before.json`` (its table has
the same columns), then this one with ``--compare before.json`` to print,
per op, eager and graphed time after / before (1.00 = no change; run-to-run
noise on the H200 is a few percent for the sub-50-us ops).

Writes JSON beside the table (``benchmarks/results/kernels_bench.json``).

    python benchmarks/kernels_bench.py            # 32K and 128K tokens
    python benchmarks/kernels_bench.py --quick    # 8K tokens, short timing loops (smoke run)
    python benchmarks/kernels_bench.py --compare before.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import traceback
from pathlib import Path

import torch

HIDDEN = 7168
PAGE = 64
INDEX_DIM = 128


def _fail(msg: str) -> None:
    print(f"kernels_bench: {msg}", file=sys.stderr)
    sys.exit(1)


try:
    import triton
    import triton.testing
except Exception as exc:  # noqa: BLE001
    _fail(f"triton is not importable ({exc}); install triton to benchmark the kernels")

try:
    import cpgraph.kernels as kernels
    from cpgraph.kernels import codecs as kcodecs
    from cpgraph.kernels import materialize as kmat
    from cpgraph.kernels import move
    from cpgraph.ops import materialize as omat
    from cpgraph.ops import codecs, paged, rows
    from cpgraph.ops.providers import bind_providers
    from cpgraph.plan import plan_prefill
except Exception:  # noqa: BLE001
    traceback.print_exc()
    _fail("cannot import cpgraph (run from the repository root after `pip install -e .`)")


class Bench:
    def __init__(self, warmup: int, rep: int):
        self.warmup, self.rep = warmup, rep
        self._copy_ms: dict[int, float] = {}

    def time_ms(self, fn) -> float:
        return float(triton.testing.do_bench(fn, warmup=self.warmup, rep=self.rep, return_mode="median"))

    def graph_ms(self, fn) -> float:
        """Median time of replaying ``fn`` captured in a CUDA graph (GPU time without host launch cost).

        Production runs these ops inside CUDA graphs (``reduce-overhead``), so
        this is the number the bandwidth target is about; the eager ``ms``
        column also pays the Python/launch time of every call, which at 32K
        tokens exceeds the GPU time of the narrow-row ops.
        """
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        try:
            return self.time_ms(graph.replay)
        finally:
            del graph

    def copy_ms(self, moved_bytes: int) -> float:
        """Median time of ``dst.copy_(src)`` moving ``moved_bytes`` in total (half read, half written)."""
        n = max(moved_bytes // 2, 1)
        if n not in self._copy_ms:
            src = torch.empty(n, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            self._copy_ms[n] = self.time_ms(lambda: dst.copy_(src))
            del src, dst
        return self._copy_ms[n]


def _same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return all(_same(x, y) for x, y in zip(a, b))
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.numel() == 0 or torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _perm_index(n_out: int, n_src: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(max(n_src, n_out), device="cuda", generator=gen)[:n_out] % max(n_src, 1)


def _with_bad_ids(idx: torch.Tensor, n_src: int, gen: torch.Generator, frac: float = 0.05) -> torch.Tensor:
    """``idx`` with ``frac`` of its entries replaced by out-of-range ids (treated like -1 by every op)."""
    bad = torch.tensor([-2, -7, n_src, n_src + 1, 2**40, -(2**40)], device="cuda")
    pick = bad[torch.randint(0, bad.numel(), idx.shape, device="cuda", generator=gen)]
    return torch.where(torch.rand(idx.shape, device="cuda", generator=gen) < frac, pick, idx.to(torch.int64))


def _row_kind(m: int, gen: torch.Generator) -> torch.Tensor:
    kind = (torch.rand(m, device="cuda", generator=gen) < 0.06).to(torch.int64)  # CP compute padding
    kind[-max(m // 64, 1) :] = 2  # static padding at the tail
    return kind


def _rerange_case(tokens: int, cp: int = 2):
    """A realistic rerange index from the planner: 4 requests, ``cp`` ranks, page 64."""
    per = tokens // 4
    plan = plan_prefill([0] * 4, [per] * 4, cp_size=cp, page_size=PAGE)
    rp = plan.rank(0, rerange=True)
    return rp.rerange_index.to("cuda"), cp * rp.num_rows


def cases(tokens: int, gen: torch.Generator):
    """Yield ``(op, shape, moved_bytes, triton_fn, reference_fn, in_place_state)`` lazily (memory)."""
    row = HIDDEN * 2
    # --- hidden rows: take_rows (a permutation), rerange placement, compaction
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    idx = _perm_index(tokens, tokens, gen)
    yield ("take_rows", f"{tokens}x{HIDDEN} bf16", 2 * tokens * row + tokens * 8,
           lambda: move.take_rows(x, idx), lambda: rows.take_rows_reference(x, idx), None)  # fmt: skip
    bad_idx = _with_bad_ids(idx, tokens, gen)
    yield ("take_rows oob", f"{tokens}x{HIDDEN} bf16, 5% bad ids", 2 * tokens * row + tokens * 8,
           lambda: move.take_rows(x, bad_idx), lambda: rows.take_rows_reference(x, bad_idx), None)  # fmt: skip
    rerange_index, gathered_rows = _rerange_case(tokens)
    gathered = torch.randn(gathered_rows, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    t = rerange_index.shape[0]
    yield ("rerange placement", f"{gathered_rows}->{t}x{HIDDEN} bf16", 2 * t * row + t * 8,
           lambda: move.take_rows(gathered, rerange_index), lambda: rows.take_rows_reference(gathered, rerange_index), None)  # fmt: skip
    del gathered
    kind = _row_kind(tokens, gen)
    valid = int((kind == 0).sum())  # bench setup, not an op body
    valid_rows = torch.nonzero(kind == 0).squeeze(1)
    yield ("compact_valid_static", f"{tokens}x{HIDDEN} bf16, {valid} valid", valid * row + tokens * row + tokens * 8 + 8,
           lambda: move.compact_valid_static(x, kind), lambda: rows.compact_valid_static_reference(x, kind), None)  # fmt: skip
    y = rows.compact_valid_static_reference(x, kind)[0]
    yield ("restore_compute_static", f"{tokens}x{HIDDEN} bf16, {valid} valid", valid * row + tokens * row + tokens * 8,
           lambda: move.restore_compute_static(y, kind), lambda: rows.restore_compute_static_reference(y, kind), None)  # fmt: skip
    yield ("compact_valid", f"{tokens}x{HIDDEN} bf16, {valid} valid", 2 * valid * row + valid * 8,
           lambda: move.compact_valid(x, valid_rows), lambda: rows.compact_valid_reference(x, valid_rows), None)  # fmt: skip
    yc = y[:valid]
    yield ("restore_compute", f"{tokens}x{HIDDEN} bf16, {valid} valid", valid * row + tokens * row + valid * 8,
           lambda: move.restore_compute(yc, valid_rows, tokens),
           lambda: rows.restore_compute_reference(yc, valid_rows, tokens), None)  # fmt: skip
    del x, y, yc

    # --- MLA FP8 records (656 B)
    latent = (torch.randn(tokens, 512, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    k_pe = torch.randn(tokens, 64, device="cuda", generator=gen).to(torch.bfloat16)
    yield ("mla_fp8_pack", f"{tokens} tok bf16 -> 656 B", tokens * (1024 + 128 + 656),
           lambda: kcodecs.mla_fp8_pack(latent, k_pe), lambda: codecs.mla_fp8_pack_reference(latent, k_pe), None)  # fmt: skip
    rec = codecs.mla_fp8_pack_reference(latent, k_pe)
    yield ("mla_fp8_unpack", f"{tokens} tok 656 B -> bf16", tokens * (656 + 1152),
           lambda: kcodecs.mla_fp8_unpack(rec, torch.bfloat16),
           lambda: codecs.mla_fp8_unpack_reference(rec, torch.bfloat16), None)  # fmt: skip
    num_slots = tokens + 16 * PAGE
    slots = _perm_index(tokens, num_slots, gen)
    pool = torch.zeros(num_slots, 656, dtype=torch.uint8, device="cuda")
    yield ("paged_store", f"{tokens} x 656 B", 2 * tokens * 656 + tokens * 8,
           lambda: move.paged_store(pool, rec, slots), lambda: paged.paged_store_reference(pool, rec, slots), pool)  # fmt: skip
    yield ("paged_gather", f"{tokens} x 656 B", 2 * tokens * 656 + tokens * 8,
           lambda: move.paged_gather(pool, slots), lambda: paged.paged_gather_reference(pool, slots), None)  # fmt: skip
    bad_slots = _with_bad_ids(slots, num_slots, gen)
    yield ("paged_store oob", f"{tokens} x 656 B, 5% bad slots", 2 * tokens * 656 + tokens * 8,
           lambda: move.paged_store(pool, rec, bad_slots), lambda: paged.paged_store_reference(pool, rec, bad_slots),
           pool)  # fmt: skip
    yield ("paged_gather oob", f"{tokens} x 656 B, 5% bad slots", 2 * tokens * 656 + tokens * 8,
           lambda: move.paged_gather(pool, bad_slots), lambda: paged.paged_gather_reference(pool, bad_slots), None)  # fmt: skip
    dense = torch.cat([latent, k_pe], dim=1)
    dpool = torch.zeros(num_slots, 576, dtype=torch.bfloat16, device="cuda")
    yield ("paged_store", f"{tokens} x 1152 B (bf16 576)", 2 * tokens * 1152 + tokens * 8,
           lambda: move.paged_store(dpool, dense, slots), lambda: paged.paged_store_reference(dpool, dense, slots), dpool)  # fmt: skip
    yield ("paged_gather", f"{tokens} x 1152 B (bf16 576)", 2 * tokens * 1152 + tokens * 8,
           lambda: move.paged_gather(dpool, slots), lambda: paged.paged_gather_reference(dpool, slots), None)  # fmt: skip
    del latent, k_pe, rec, pool, dense, dpool

    # --- index-K pages (132 B per token at D = 128)
    keys = (torch.randn(tokens, INDEX_DIM, device="cuda", generator=gen) * 5).to(torch.bfloat16)
    yield ("index_k_page_pack", f"{tokens} tok bf16 -> 132 B, page {PAGE}", tokens * (256 + 132),
           lambda: kcodecs.index_k_page_pack(keys, PAGE), lambda: codecs.index_k_page_pack_reference(keys, PAGE), None)  # fmt: skip
    pages = torch.zeros(num_slots // PAGE, PAGE * 132, dtype=torch.uint8, device="cuda")
    yield ("index_k_store", f"{tokens} tok bf16 -> 132 B, page {PAGE}", tokens * (256 + 132 + 8),
           lambda: kcodecs.index_k_store(pages, keys, slots, PAGE),
           lambda: paged.index_k_store_reference(pages, keys, slots, PAGE), pages)  # fmt: skip
    yield ("index_k_gather", f"{tokens} x 132 B, page {PAGE}", tokens * (2 * 132 + 8),
           lambda: move.index_k_gather(pages, slots, PAGE, INDEX_DIM),
           lambda: paged.index_k_gather_reference(pages, slots, PAGE, INDEX_DIM), None)  # fmt: skip
    yield ("index_k_store oob", f"{tokens} tok bf16 -> 132 B, 5% bad slots", tokens * (256 + 132 + 8),
           lambda: kcodecs.index_k_store(pages, keys, bad_slots, PAGE),
           lambda: paged.index_k_store_reference(pages, keys, bad_slots, PAGE), pages)  # fmt: skip
    yield ("index_k_gather oob", f"{tokens} x 132 B, 5% bad slots", tokens * (2 * 132 + 8),
           lambda: move.index_k_gather(pages, bad_slots, PAGE, INDEX_DIM),
           lambda: paged.index_k_gather_reference(pages, bad_slots, PAGE, INDEX_DIM), None)  # fmt: skip
    del keys, pages

    # --- materialisation: pack (prefix + current rows of every kind -> send rows) and placement
    #     (gathered packed rows -> every kind's full view), packed layout of cpgraph.ops.materialize
    cur = [
        torch.randint(0, 256, (tokens, 656), device="cuda", generator=gen).to(torch.uint8),
        torch.randint(0, 256, (tokens, 128), device="cuda", generator=gen).to(torch.uint8),
        torch.rand(tokens, 1, device="cuda", generator=gen),
    ]
    pre = [c[: 8 * PAGE] for c in cur]
    payload = sum(c.shape[1] * c.element_size() for c in cur)  # 788 B of payload per row
    columns, packed = omat.packed_columns(cur)  # 792-B packed rows (8-byte aligned kinds)
    n_send = pre[0].shape[0] + tokens
    yield ("materialize pack", f"{n_send} x (656+128+4) B -> {packed} B", n_send * (payload + packed),
           lambda: kmat.pack_rows(pre, cur, columns, packed),
           lambda: omat.pack_reference(pre, cur, columns, packed), None)  # fmt: skip
    gathered_b = torch.randint(0, 256, (tokens + 32 * PAGE, packed), device="cuda", generator=gen).to(torch.uint8)
    source = _perm_index(tokens, gathered_b.shape[0], gen)
    yield ("materialize placement", f"{tokens} x (656+128+4) B", 2 * tokens * payload + tokens * 8,
           lambda: kmat.place_rows(gathered_b, source, columns, cur),
           lambda: omat.place_reference(gathered_b, source, columns, cur), None)  # fmt: skip


def run_table(bench: Bench, tokens_list, seed: int) -> list[dict]:
    results = []
    for tokens in tokens_list:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for op, shape, moved, fn, ref, state in cases(tokens, gen):
            entry = {"op": op, "shape": shape, "tokens": tokens, "bytes": moved}
            try:
                if state is not None:  # in-place op: same starting bytes for both, compare the state
                    start = state.clone()
                    fn()
                    got = state.clone()
                    state.copy_(start)
                    ref()
                    entry["exact"] = _same(got, state)
                    del start, got
                else:
                    entry["exact"] = _same(fn(), ref())
                t = bench.time_ms(fn)
                t_ref = bench.time_ms(ref)
                t_copy = bench.copy_ms(moved)
                entry.update(
                    ms=t, ref_ms=t_ref, copy_ms=t_copy, gbps=moved / t / 1e6, copy_gbps=moved / t_copy / 1e6,
                    frac_copy=t_copy / t, speedup_vs_ref=t_ref / t,
                )  # fmt: skip
                try:
                    t_graph = bench.graph_ms(fn)
                    entry.update(graph_ms=t_graph, frac_copy_graph=t_copy / t_graph)
                except Exception as exc:  # noqa: BLE001 - the eager numbers stand on their own
                    entry["graph_error"] = f"{type(exc).__name__}: {exc}"
            except Exception as exc:  # noqa: BLE001 - report and go on with the other ops
                entry["error"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            results.append(entry)
            torch.cuda.empty_cache()
    return results


def run_rerange(bench: Bench, tokens_list, seed: int) -> list[dict]:
    """Local copy as the all-gather stand-in: unfused (copy + placement) and folded placement."""
    out = []
    for tokens in tokens_list:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        index, gathered_rows = _rerange_case(tokens)
        send = torch.randn(gathered_rows, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
        gathered = torch.empty_like(send)

        def copy_only():
            gathered.copy_(send)

        def copy_then_place():
            gathered.copy_(send)
            return move.take_rows(gathered, index)

        def copy_then_place_ref():
            gathered.copy_(send)
            return rows.take_rows_reference(gathered, index)

        def folded():  # rows go straight from the (concatenated) per-rank send buffers to final positions
            return move.take_rows(send, index)

        exact = _same(folded(), copy_then_place_ref()) and _same(copy_then_place(), copy_then_place_ref())
        t_copy = bench.time_ms(copy_only)
        t_unfused = bench.time_ms(copy_then_place)
        t_ref = bench.time_ms(copy_then_place_ref)
        t_fold = bench.time_ms(folded)
        out.append(
            {
                "tokens": index.shape[0], "gathered_rows": gathered_rows, "copy_ms": t_copy, "copy_place_ms": t_unfused,
                "copy_place_ref_ms": t_ref, "folded_ms": t_fold, "exact": exact,
                "unfused_over_copy": t_unfused / t_copy, "folded_over_copy": t_fold / t_copy,
                "ref_over_copy": t_ref / t_copy,
            }
        )  # fmt: skip
        del send, gathered
        torch.cuda.empty_cache()
    return out


def print_tables(device: str, results: list[dict], rerange: list[dict]) -> None:
    print(f"\ncpgraph Triton kernels on {device} (torch {torch.__version__}, triton {triton.__version__})")
    print("GB/s = bytes the op must move (inputs read once + outputs written once) / median time;")
    print("%copy = achieved GB/s / dst.copy_(src) GB/s of the same bytes in this run; x ref = ref time / Triton time")
    print("graph ms / %cp-g = the same call replayed from a CUDA graph (GPU time, no host launch cost)\n")
    hdr = (
        f"{'op':<24} {'shape':<34} {'MB':>8} {'ms':>8} {'GB/s':>8} {'copy GB/s':>9} {'%copy':>6} {'ref ms':>8} "
        f"{'x ref':>6} {'graph ms':>8} {'%cp-g':>6} exact"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        if "error" in r:
            print(f"{r['op']:<24} {r['shape']:<34} ERROR {r['error']}")
            continue
        print(
            f"{r['op']:<24} {r['shape']:<34} {r['bytes'] / 1e6:>8.1f} {r['ms']:>8.3f} {r['gbps']:>8.0f} "
            f"{r['copy_gbps']:>9.0f} {100 * r['frac_copy']:>5.0f}% {r['ref_ms']:>8.3f} {r['speedup_vs_ref']:>6.2f} "
            + (f"{r['graph_ms']:>8.3f} {100 * r['frac_copy_graph']:>5.0f}% " if "graph_ms" in r else f"{'-':>8} {'-':>6} ")
            + f"{'yes' if r['exact'] else 'NO'}"
        )
    print("\nRerange on ONE GPU: a local dst.copy_(src) of the gathered bytes stands in for the NCCL all-gather.")
    print("folded = placement reads the per-rank send rows and writes final positions directly (no gathered copy).")
    hdr = f"{'tokens':>8} {'copy ms':>8} {'copy+place':>10} {'x copy':>7} {'copy+ref':>9} {'x copy':>7} {'folded':>8} {'x copy':>7} exact"
    print(hdr)
    print("-" * len(hdr))
    for r in rerange:
        print(
            f"{r['tokens']:>8} {r['copy_ms']:>8.3f} {r['copy_place_ms']:>10.3f} {r['unfused_over_copy']:>7.2f} "
            f"{r['copy_place_ref_ms']:>9.3f} {r['ref_over_copy']:>7.2f} {r['folded_ms']:>8.3f} {r['folded_over_copy']:>7.2f} "
            f"{'yes' if r['exact'] else 'NO'}"
        )


def _key(r: dict) -> tuple:
    return (r["op"], r["shape"], r["tokens"])


def print_compare(results: list[dict], before_path: Path) -> list[dict]:
    """Per op present in both runs: eager and graphed time after / before (same columns, same shapes)."""
    try:
        before = {_key(r): r for r in json.loads(before_path.read_text())["ops"] if "error" not in r}
    except (OSError, ValueError, KeyError) as exc:
        _fail(f"--compare {before_path}: cannot read an earlier kernels_bench JSON ({exc})")
    rows_out = []
    print(f"\nCompared with {before_path} (after / before; 1.00 = same time, < 1 faster)")
    hdr = f"{'op':<24} {'shape':<34} {'ms before':>9} {'ms after':>9} {'x':>6} {'graph before':>12} {'graph after':>11} {'x':>6}"
    print(hdr)
    print("-" * len(hdr))
    ratios = []
    for r in results:
        b = before.get(_key(r))
        if b is None or "error" in r:
            continue
        entry = {"op": r["op"], "shape": r["shape"], "tokens": r["tokens"], "ms_ratio": r["ms"] / b["ms"]}
        g = ""
        if "graph_ms" in r and "graph_ms" in b:
            entry["graph_ratio"] = r["graph_ms"] / b["graph_ms"]
            ratios.append(entry["graph_ratio"])
            g = f"{b['graph_ms']:>12.4f} {r['graph_ms']:>11.4f} {entry['graph_ratio']:>6.3f}"
        print(f"{r['op']:<24} {r['shape']:<34} {b['ms']:>9.4f} {r['ms']:>9.4f} {entry['ms_ratio']:>6.3f} {g}")
        rows_out.append(entry)
    if ratios:
        ratios.sort()
        geo = 1.0
        for x in ratios:
            geo *= x ** (1.0 / len(ratios))
        print(f"graphed time after/before over {len(ratios)} ops: geometric mean {geo:.3f}, "
              f"median {ratios[len(ratios) // 2]:.3f}, range {ratios[0]:.3f}-{ratios[-1]:.3f}")  # fmt: skip
    return rows_out


def _provenance() -> dict:
    """Which cpgraph the run imported and its git commit (so a before/after pair is unambiguous)."""
    import subprocess

    root = Path(kernels.__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"cpgraph": str(root), "commit": commit}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8K tokens and short timing loops (smoke run)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="token counts (default 32768 131072)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "kernels_bench.json")
    ap.add_argument("--compare", type=Path, default=None, metavar="BEFORE_JSON",
                    help="an earlier run's JSON (e.g. of the commit before a kernel change): print after/before times")  # fmt: skip
    args = ap.parse_args()
    if args.compare is not None and not args.compare.is_file():
        _fail(f"--compare {args.compare}: no such file")
    if not torch.cuda.is_available():
        _fail("needs a CUDA device (the Triton kernels are GPU providers; CPU tests run under TRITON_INTERPRET=1)")
    if not bind_providers("cuda"):
        _fail("cpgraph.kernels registered no providers (see the log for why)")
    tokens = args.tokens or ([8192] if args.quick else [32 * 1024, 128 * 1024])
    bench = Bench(warmup=5 if args.quick else 25, rep=20 if args.quick else 100)
    device = torch.cuda.get_device_name()
    results = run_table(bench, tokens, args.seed)
    rerange = run_rerange(bench, tokens, args.seed)
    print_tables(device, results, rerange)
    compared = print_compare(results, args.compare) if args.compare is not None else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        **_provenance(),
        "device": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "quick": args.quick,
        "ops": results,
        "rerange_one_gpu_local_copy_stand_in": rerange,
    }
    if compared is not None:
        payload["compared_with"] = {"path": str(args.compare), "ops": compared}
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    if any("error" in r or not r.get("exact", False) for r in results) or not all(r["exact"] for r in rerange):
        print("kernels_bench: some op failed or was not bit-exact (see above)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
