"""Launch parameters of the Triton indexer kernels (scoring and top-k selection), in one place.

Values never change results, only speed (``FP8_ACC_GROUP`` changes FP8 rounding only), so a
machine can carry its own: ``CPGRAPH_INDEXER_TUNING=file.json`` overrides any of them at import,
and :func:`set_tuning` at run time (benchmark sweeps).  Defaults are tuned on an H200 for 64
heads x 128 and top-k 2048 (``benchmarks/indexer_bench.py``).
"""

from __future__ import annotations

import json
import logging
import os

log = logging.getLogger("cpgraph.kernels")

_TUNE = {
    # bf16/fp16 scoring: MMA_ROWS query-row heads x KEY_TILE keys per dot.  256 (four query rows of 64 heads a
    # program): H200, 32K causal rows at the 1 GiB score budget, 13 tiles swept (benchmarks/indexer_bench.py
    # --sweep, 2026-12-05): 15.63 -> 14.23 ms (563 -> 618 TFLOP/s); in the two-layer forward 31.7 -> 29.1-29.5 ms.
    "MMA_ROWS": 256,
    "KEY_TILE": 64,
    "SCORE_WARPS": 4,
    "SCORE_STAGES": 3,
    # Keys on the MMA's M axis and query-row heads on N: the head sum then stays within a thread's
    # registers (plus one quad shuffle) instead of crossing warps through shared memory.
    "KEYS_M": True,
    # FP8 dots: products accumulated in fp32 every FP8_ACC_GROUP of the head dim (32: every Hopper
    # e4m3 MMA group promoted, as in the DeepGEMM GEMMs; 0: the whole head dim in the MMA accumulator,
    # as DeepGEMM's mqa-logits kernel does for D = 128).
    "FP8_ACC_GROUP": 0,
    # The FP8 scoring tile, tuned apart from the bf16 one (half the operand bytes, twice the MMA rate:
    # the ReLU / weight / head-sum epilogue weighs twice as much against the dot).  Four query rows a program
    # here too: H200, same sweep as the bf16 tile (2026-12-05, second run): 10.07 -> 9.71 ms (874 -> 906
    # TFLOP/s), 1.45x the best bf16 tile's 14.02 ms in the same run.
    "FP8_MMA_ROWS": 256,
    "FP8_KEY_TILE": 64,
    "FP8_SCORE_WARPS": 4,
    "FP8_SCORE_STAGES": 3,
    "FP8_KEYS_M": True,
    # Register caps (0: the compiler's choice).
    "SCORE_MAXNREG": 0,
    "FP8_SCORE_MAXNREG": 0,
    # Selection (cpgraph/kernels/topk_select.py): window elements per step, warps per row program,
    # sampled keys that bracket the k-th key, register cap.
    # Swept on an H200 at 32K causal rows, k = 2048 (benchmarks/topk_select_bench.py --sweep --stages, 2026-12-05,
    # 14 forms, all exact): one warp a row program with 128-key steps, the fp32-compare window pass and the
    # one-entry-a-thread list walks take one launch over a layer's rows to 2.21 ms on indexer-like scores
    # (the previous default 2.96 in the same run; 2.15 Gaussian, 2.01 all tied); in the two-layer forward 6.4-6.7 ms.
    # One warp: its scans and sums need no cross-warp barrier, and about 30 row programs fit an SM,
    # which hides the passes' dependent latency.
    "SELECT_BLOCK": 128,
    "SELECT_WARPS": 1,
    "SELECT_SAMPLE": 512,
    "SELECT_MAXNREG": 0,
    # Software-pipelining depth of the selection's window loop (0: Triton's default).
    "SELECT_STAGES": 0,
    # The refinement's later passes read a copy of the first digit's candidates, not the whole list.
    "SELECT_COMPACT": True,
    # The rank-bit window pass loads block i + 1 before it scans block i (register double buffering).  The
    # float pass below replaces that pass, so this only matters with SELECT_FLOAT_PASS off (2.70 ms a launch
    # with the list steps, against the float pass's 2.21).
    "SELECT_PREFETCH": False,
    # The window pass compares fp32 scores with the bracket's bounds in one-key-a-thread steps and
    # converts only the list to rank bits: 171 instructions per 128 keys in its loop against 276
    # (sm_90 SASS, benchmarks/sass_loops.py); on the H200 the window pass 1.71 -> 1.21 ms a layer
    # and, with the list steps below, the refinement 0.53 -> 0.32 ms (indexer-like scores, --stages).
    "SELECT_FLOAT_PASS": True,
    # The list walks -- the refinement's histogram passes and the collection -- in one-entry-a-thread steps
    # (32 x warps entries, four a round, the round's counts packed a byte a step: SELECT_WARPS < 8) instead of
    # SELECT_BLOCK steps, so no values move between layouts through shared memory.  sm_90 SASS per 128 entries
    # at one warp (benchmarks/sass_loops.py; counts, not times): the histogram loop 282 -> 198 instructions in
    # the pass that also copies (155 -> 139 in the others), the collection 187 -> 172; with SELECT_FLOAT_PASS
    # 283 -> 195 and 191 -> 171.  At 4 warps the collection is 210 -> 227 (two cross-warp scans a round).
    "SELECT_LIST_STEP": True,
    # Launch the selection's rows last first (causal windows grow with the row: longest first).
    "SELECT_LAST_ROW_FIRST": True,
}


def tuning() -> dict:
    """The launch parameters in use."""
    return dict(_TUNE)


def get(name: str):
    return _TUNE[name]


def set_tuning(**values) -> None:
    """Override launch parameters (names of :func:`tuning`); a wrong name, type or value raises ``ValueError``."""
    for name, value in values.items():
        if name not in _TUNE:
            raise ValueError(f"cpgraph.kernels.indexer: unknown tuning parameter {name!r}; known: {sorted(_TUNE)}")
        if type(value) is not type(_TUNE[name]):
            raise ValueError(f"cpgraph.kernels.indexer: tuning parameter {name!r} must be "
                             f"{type(_TUNE[name]).__name__}, got {value!r}")
    if values.get("FP8_ACC_GROUP", 0) not in (0, 32, 64, 128):
        raise ValueError(f"cpgraph.kernels.indexer: FP8_ACC_GROUP must be 0, 32, 64 or 128, got {values['FP8_ACC_GROUP']!r}")
    sample = values.get("SELECT_SAMPLE", 1024)
    if sample & (sample - 1) or not 16 <= sample <= 4096:
        raise ValueError(f"cpgraph.kernels.indexer: SELECT_SAMPLE must be a power of two in [16, 4096], got {sample!r}")
    block = values.get("SELECT_BLOCK", 4096)
    if block & (block - 1) or not 16 <= block <= (1 << 15):
        raise ValueError(f"cpgraph.kernels.indexer: SELECT_BLOCK must be a power of two in [16, 32768] (packed 16-bit "
                         f"counts), got {block!r}")
    merged = dict(_TUNE, **values)
    if merged["SELECT_LIST_STEP"] and 32 * merged["SELECT_WARPS"] >= 256:
        raise ValueError(f"cpgraph.kernels.indexer: SELECT_LIST_STEP needs SELECT_WARPS < 8 (32 x warps-entry steps, "
                         f"byte-packed counts), got {merged['SELECT_WARPS']}")
    _TUNE.update(values)


def tuning_from_env() -> None:
    """Apply ``CPGRAPH_INDEXER_TUNING`` (a JSON object of :func:`tuning` names) when it is set."""
    path = os.environ.get("CPGRAPH_INDEXER_TUNING", "")
    if path:
        with open(path) as f:
            set_tuning(**json.load(f))
        log.info("cpgraph.kernels.indexer: tuning from %s: %s", path, _TUNE)


tuning_from_env()
