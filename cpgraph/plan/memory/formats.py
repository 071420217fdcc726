"""Byte sizes of the dtypes and cache formats, and the argument checks every part of the plan shares.

Why one module: the weights, the KV cache and the activations all price a
value by the same dtype table (FP8 weights compute in bf16) and reject a bad
argument with the same one-line ``plan_memory: argument ...`` error, so
those facts are written once, below every other part of the planner.
"""

from __future__ import annotations

import numpy as np

# Byte facts of the cache formats (the codecs define them; tests check these against cpgraph.ops.codecs).
MLA_FP8_RECORD_BYTES = 656  # 512 e4m3 latent + 4 fp32 scales + 64 bf16 RoPE
FP8_SCALE_BLOCK = 128  # values per scale (index-K keys; weight blocks are 128 x 128)
DEFAULT_MAX_LOGITS_BYTES = 1 << 30  # KVLayout.max_logits_bytes' default: the dense indexer's score chunk budget

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}
KV_FORMATS = ("bf16", "dense", "fp8")


def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"plan_memory: argument '{name}' must be an int >= {minimum}, got {value!r}")
    return int(value)


def _act_bytes(dtype: str) -> int:
    """Bytes of one activation / dense-cache value: the model dtype; FP8 weights compute in bf16."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"plan_memory: argument 'dtype' must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return 2 if dtype == "fp8" else DTYPE_BYTES[dtype]
