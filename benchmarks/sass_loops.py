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
    python benchmarks/sass_loops.py --list-step [--float-pass] [--paged]  # the list walks one entry a thread

A loop is a backward branch's range; nested loops are listed inside their parents.  Each is named by
its backward branch's source line (``function:line`` and the ``while`` there, from the cubin's line
table through ``nvdisasm -g``), and a forward branch in its body is listed with the instructions it
can skip (e.g. the refinement's copy, taken in one pass of several).  At the default tuning (one
warp, 128-key blocks) one iteration of every window or list loop covers 128 keys or entries, in both
the ``BLOCK`` form and the one-entry-a-thread forms (four 32-entry steps a round).
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
                   paged: bool = False, maxnreg: int = 0, list_step: bool = False):
    """The selection kernel compiled for sm_90 (a CompiledKernel: ``asm['cubin']``, ``asm['ttgir']``)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from cpgraph.kernels import topk_select as ts

    fn = ts._select_kernel
    const = dict(BLOCK=block, SAMPLE=sample, PAGED=paged, LOOP_WHILE=False, LAST_ROW_FIRST=True, COMPACT=compact,
                 PREFETCH=prefetch, FLOAT_PASS=float_pass, PASS_STEP=32 * warps, STOP_AFTER=0, LIST_STEP=list_step)
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


def _cuda_tool(name: str, cubin: bytes, *flags: str) -> str:
    """The output of Triton's bundled ``cuobjdump``/``nvdisasm`` run on ``cubin``."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        Path(path).write_bytes(cubin)
        return subprocess.run([str(tool), *flags, path], capture_output=True, text=True, check=True).stdout


def sass_of(cubin: bytes) -> str:
    return _cuda_tool("cuobjdump", cubin, "-sass")


def registers(cubin: bytes) -> int | None:
    """Registers a thread (they bound the resident row programs per SM)."""
    m = re.search(r"REG:(\d+)", _cuda_tool("cuobjdump", cubin, "-res-usage"))
    return int(m.group(1)) if m else None


def source_lines(cubin: bytes) -> dict[int, tuple[str, int]]:
    """``address -> (file, line)`` from the cubin's line table (``nvdisasm -g``; Triton compiles with line info)."""
    lines, at = {}, None
    for text in _cuda_tool("nvdisasm", cubin, "-g").splitlines():
        m = re.match(r'\s*//## File "(.*)", line (\d+)', text)
        if m:
            at = (m.group(1), int(m.group(2)))
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/", text)
        if m and at:
            lines[int(m.group(1), 16)] = at
    return lines


def label_loops(found: list[dict], lines: dict[int, tuple[str, int]]) -> None:
    """Name each loop by its backward branch's source line: ``function:line`` and the ``while`` statement there."""
    import ast

    funcs: dict[str, list[tuple[int, int, str]]] = {}
    for lp in found:
        file, line = lines.get(lp["end"], ("", 0))
        if not file.endswith(".py") or not os.path.exists(file):
            continue
        if file not in funcs:
            tree = ast.parse(Path(file).read_text())
            funcs[file] = [(n.lineno, n.end_lineno, n.name) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
        name = min((f for f in funcs[file] if f[0] <= line <= f[1]), key=lambda f: f[1] - f[0], default=(0, 0, "?"))[2]
        lp["at"] = f"{name}:{line}"
        lp["source"] = Path(file).read_text().splitlines()[line - 1].split("#")[0].strip()


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
    """Every backward branch's range with its instruction count and opcode mix, in address order of the branch.

    ``skips``: the forward branches of the loop's own body (not of a loop nested in it) and how many
    instructions each can jump over, so a path that skips an ``if`` can be counted apart.
    """
    found = []
    for addr, text in ins:
        m = re.search(r"BRA (?:\S+ )?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) <= addr:
            start = int(m.group(1), 16)
            body = [t for a, t in ins if start <= a <= addr]
            mix: dict[str, int] = {}
            for t in body:
                mix[opcode(t)] = mix.get(opcode(t), 0) + 1
            # Forward branches inside the loop: the instructions they can skip (an ``if`` in the body).
            skips = []
            for a, t in ins:
                f = re.search(r"BRA (?:\S+ )?0x([0-9a-f]+)", t)
                if f and start <= a < int(f.group(1), 16) <= addr:
                    skips.append({"from": a, "to": int(f.group(1), 16),
                                  "instructions": sum(1 for b, _ in ins if a < b < int(f.group(1), 16))})
            found.append({"start": start, "end": addr, "instructions": len(body),
                          "mix": dict(sorted(mix.items(), key=lambda kv: -kv[1])), "skips": skips})
    for lp in found:  # a branch belongs to the innermost loop around it
        lp["skips"] = [sk for sk in lp["skips"]
                       if not any(lp["start"] <= o["start"] <= sk["from"] <= o["end"] and o is not lp
                                  and o["end"] - o["start"] < lp["end"] - lp["start"] for o in found)]
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
    ap.add_argument("--list-step", action=argparse.BooleanOptionalAction, default=t["SELECT_LIST_STEP"],
                    help="the list's histogram passes and collection in one-entry-a-thread steps")
    ap.add_argument("--paged", action="store_true", help="the PAGED form (slot ids out)")
    ap.add_argument("--json", default="")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    kernel = compile_select(args.block, args.warps, args.sample, args.compact, args.prefetch, args.float_pass,
                            args.paged, args.maxnreg, args.list_step)
    cubin = kernel.asm["cubin"]
    ins = instructions(sass_of(cubin))
    found = loops(ins)
    label_loops(found, source_lines(cubin))
    regs = registers(cubin)
    variant = {k: getattr(args, k) for k in ("block", "warps", "sample", "maxnreg", "compact", "prefetch",
                                             "float_pass", "list_step", "paged")}
    print(f"_select_kernel sm_90 {variant}: {len(ins)} instructions, {regs} registers, "
          f"{kernel.metadata.shared} B shared")
    for lp in found:
        mix = ", ".join(f"{k} {v}" for k, v in list(lp["mix"].items())[:12])
        where = f" [{lp['at']}: {lp['source']}]" if "at" in lp else ""
        print(f"  loop {lp['start']:#07x}-{lp['end']:#07x}: {lp['instructions']:4d} instructions{where}; {mix}")
        for sk in lp["skips"]:
            print(f"      a branch at {sk['from']:#07x} can skip {sk['instructions']} of them")
    if args.json:
        Path(args.json).write_text(json.dumps({"variant": variant, "instructions": len(ins), "registers": regs,
                                               "shared": kernel.metadata.shared, "loops": found}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
