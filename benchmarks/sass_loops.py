"""Instruction counts of the selection kernel's loops, compiled for an H100/H200 (sm_90) on any machine.

Why: GPU time is scarce and the selection is bound by instructions per key, not by bytes.  Triton
compiles to SASS without a GPU (its wheel carries ``ptxas`` and ``cuobjdump``), so a change to the
kernel can be counted here before a GPU times it: the loop bodies' instruction counts, and their mix
(shuffles, barriers, shared-memory moves that betray a layout conversion), per variant.  Counts are
not times -- latency, occupancy and memory still decide those -- but an instruction removed from a
loop that runs once per 32 keys of every row is a real saving, and one added is a real cost.

    python benchmarks/sass_loops.py                                  # the default tuning
    python benchmarks/sass_loops.py --block 128 --warps 1 --float-pass --json out.json
    python benchmarks/sass_loops.py --block 512 --warps 4 --no-compact --no-prefetch   # the old default

A loop is a backward branch's range; nested loops are listed inside their parents.  Which loop is
which: the window pass stores to the list (two ``STG`` a key of a step) and loads the window
(``LDG``); the refinement's histograms use ``VOTE``/``POPC``; the collection stores once a key.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Compiles, never launches: the interpreter (which CI sets for the suite) would hide the compiler's kernel.
os.environ["TRITON_INTERPRET"] = "0"

_SIGNATURE = {"scores": "*fp32", "ks": "*i64", "ke": "*i64", "kv_slots": "*i64", "out": "*i32", "cand": "*i32",
              "row0": "i32", "m_rows": "i32", "n_keys": "i32", "score_stride": "i32", "cand_stride": "i32",
              "cand_cap": "i32", "topk": "i32"}
# Arguments the launcher specialises as multiples of 16 at production shapes (pointers, 32K strides, k = 2048).
_DIVISIBLE = ("scores", "ks", "ke", "kv_slots", "out", "cand", "score_stride", "cand_stride", "topk")


def compile_select(block: int, warps: int, sample: int, compact: bool, prefetch: bool, float_pass: bool,
                   paged: bool = False, maxnreg: int = 0):
    """The selection kernel compiled for sm_90 (a CompiledKernel: ``asm['cubin']``, ``asm['ttgir']``)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from cpgraph.kernels import topk_select as ts

    fn = ts._select_kernel
    const = dict(BLOCK=block, SAMPLE=sample, PAGED=paged, LOOP_WHILE=False, LAST_ROW_FIRST=True, COMPACT=compact,
                 PREFETCH=prefetch, FLOAT_PASS=float_pass, PASS_STEP=32 * warps, STOP_AFTER=0)
    names = list(fn.arg_names)
    missing = [n for n in names if n not in _SIGNATURE and n not in const]
    if missing:
        raise SystemExit(f"sass_loops: the kernel has parameters this script does not know: {missing}")
    const = {k: v for k, v in const.items() if k in names}
    signature = dict(_SIGNATURE, **{k: "constexpr" for k in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in _DIVISIBLE}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=const, attrs=attrs)
    options = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def sass_of(cubin: bytes) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        Path(path).write_bytes(cubin)
        return subprocess.run([str(tool), "-sass", path], capture_output=True, text=True, check=True).stdout


def instructions(sass: str) -> list[tuple[int, str]]:
    """``(address, instruction)`` of every SASS instruction, predicates kept."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def opcode(instr: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instr).split()[0].split(".")[0]


def loops(ins: list[tuple[int, str]]) -> list[dict]:
    """Every backward branch's range with its instruction count and opcode mix, innermost first by size."""
    found = []
    for addr, text in ins:
        m = re.search(r"BRA (?:\S+ )?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) <= addr:
            start = int(m.group(1), 16)
            body = [t for a, t in ins if start <= a <= addr]
            mix: dict[str, int] = {}
            for t in body:
                mix[opcode(t)] = mix.get(opcode(t), 0) + 1
            found.append({"start": start, "end": addr, "instructions": len(body),
                          "mix": dict(sorted(mix.items(), key=lambda kv: -kv[1]))})
    return found


def parse_args(argv=None):
    from cpgraph.kernels import indexer_tuning as tune

    t = tune.tuning()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block", type=int, default=t["SELECT_BLOCK"])
    ap.add_argument("--warps", type=int, default=t["SELECT_WARPS"])
    ap.add_argument("--sample", type=int, default=t["SELECT_SAMPLE"])
    ap.add_argument("--maxnreg", type=int, default=t["SELECT_MAXNREG"])
    ap.add_argument("--compact", action=argparse.BooleanOptionalAction, default=t["SELECT_COMPACT"])
    ap.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=t["SELECT_PREFETCH"])
    ap.add_argument("--float-pass", action=argparse.BooleanOptionalAction, default=t["SELECT_FLOAT_PASS"])
    ap.add_argument("--paged", action="store_true", help="the PAGED form (slot ids out)")
    ap.add_argument("--json", default="")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    kernel = compile_select(args.block, args.warps, args.sample, args.compact, args.prefetch, args.float_pass,
                            args.paged, args.maxnreg)
    ins = instructions(sass_of(kernel.asm["cubin"]))
    found = loops(ins)
    variant = {k: getattr(args, k) for k in ("block", "warps", "sample", "maxnreg", "compact", "prefetch",
                                             "float_pass", "paged")}
    print(f"_select_kernel sm_90 {variant}: {len(ins)} instructions, {kernel.metadata.shared} B shared")
    for lp in found:
        mix = ", ".join(f"{k} {v}" for k, v in list(lp["mix"].items())[:12])
        print(f"  loop {lp['start']:#07x}-{lp['end']:#07x}: {lp['instructions']:4d} instructions; {mix}")
    if args.json:
        Path(args.json).write_text(json.dumps({"variant": variant, "instructions": len(ins),
                                               "shared": kernel.metadata.shared, "loops": found}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
