"""Bookings of single ops that more than one part of a layer calls: RoPE, the KV view, the fp32 products.

Why shared: the attention and the indexer both rotate their keys and
compose a full key view; the indexer's ``weights_proj`` and the MoE router
both run ``fp32_linear``, whose two forms (a bf16 split GEMM, or an fp32
copy of ``x``) must be booked the same way wherever it runs.
"""

from __future__ import annotations

from .tape import _Tape


def _rope(t: _Tape, name: str, nbytes: int) -> None:
    """``rope_interleaved`` / ``rope_neox`` of a ``nbytes`` operand: the two rotated halves are live beside the output."""
    t.alloc(name + ".halves", nbytes)
    t.alloc(name, nbytes)
    t.free(name + ".halves")


def _compose(t: _Tape, name: str, rows: int, keys: int, row_bytes: int) -> None:
    """``kv_compose`` of the cached prefix (``keys - rows`` gathered rows) and this forward's rows into a view."""
    t.alloc(name + ".prefix", (keys - rows) * row_bytes)
    t.alloc(name + ".cat", keys * row_bytes)
    t.alloc(name, keys * row_bytes)
    t.free(name + ".cat", name + ".prefix")


def _split_fp32_products(dtype: str, deterministic: bool) -> bool:
    """Whether ``models/fp32_linear.py`` computes the fp32 products as its bf16 split GEMM (``uses_split``).

    On CUDA it does for bf16 activations (bf16 or FP8 weights) outside the deterministic mode; with
    fp16 or fp32 activations, or in that mode, it upcasts ``x`` and runs the fp32 GEMM.
    """
    return dtype in ("bf16", "bfloat16", "fp8") and not deterministic


def _fp32_product(t: _Tape, name: str, R: int, K: int, N: int, a: int, split: bool) -> None:
    """``fp32_linear(x [R, K], w [N, K])`` of an fp32 weight; leaves ``name`` fp32 ``[R, N]`` live.

    Why two forms: on CUDA with bf16 activations (``split``) no fp32 copy of ``x`` exists -- the
    product is one bf16 GEMM against the weight's three bf16 parts (``bf16_parts``, rebuilt each
    call) with an fp32 ``[R, 3N]`` output, summed block by block; otherwise ``x.float()`` is a
    ``[R, K]`` fp32 copy beside the output (none when ``x`` is fp32 already: ``.float()`` returns it).
    """
    if not split:
        if a != 4:
            t.alloc(name + ".x32", 4 * R * K)
        t.alloc(name, 4 * R * N)
        t.free(name + ".x32")
        return
    nk = N * K  # bf16_parts(w), line by line; its locals go when it returns
    t.alloc(name + ".hi", 2 * nk)
    t.alloc(name + ".hi32", 4 * nk)  # hi.float()
    t.alloc(name + ".r", 4 * nk)
    t.free(name + ".hi32")
    t.alloc(name + ".mid", 2 * nk)
    t.alloc(name + ".mid32", 4 * nk)  # mid.float()
    t.alloc(name + ".r2", 4 * nk)  # r - mid.float()
    t.free(name + ".mid32")
    t.alloc(name + ".lo", 2 * nk)
    t.free(name + ".r2")
    t.alloc(name + ".parts", 3 * 2 * nk)  # cat((hi, mid, lo))
    t.free(name + ".hi", name + ".r", name + ".mid", name + ".lo")
    t.alloc(name + ".y", 4 * R * 3 * N)  # torch.mm(x, parts.t(), out_dtype=fp32)
    t.free(name + ".parts")  # a temporary argument of the mm
    t.alloc(name + ".sum", 4 * R * N)  # y[:, :n] + y[:, n:2n]
    t.alloc(name, 4 * R * N)  # ... + y[:, 2n:]
    t.free(name + ".sum", name + ".y")
