"""Which ``cpgraph::moe_experts`` implementation the plan books: the providers, the default, what applies.

Why its own module: the choice follows ``kernels/moe.py``'s per-call rules
(dtype, the deterministic mode, DeepGEMM's operand sizes) and is made once
per plan, before any buffer is booked: a provider that cannot compute these
experts is refused with one line, whatever the bookings would have been.
"""

from __future__ import annotations

# The implementations of ``cpgraph::moe_experts`` as its provider report names them (``cpgraph.ops.providers``):
# ``reference`` the dense torch form; ``triton`` the grouped path of ``kernels/moe.py`` (bf16 ``torch._grouped_mm``
# with the Triton SwiGLU, or FP8 ``kernels/fp8_grouped.py``; in the deterministic mode the Triton provider of
# ``cpgraph::invariant_moe_experts``); ``deep_gemm`` the padded layout of ``kernels/deep_gemm_experts.py``.
EXPERTS_PROVIDERS = ("reference", "triton", "deep_gemm")


def default_experts_provider(cfg, dtype: str = "bf16", deterministic: bool = False) -> str:
    """The ``cpgraph::moe_experts`` implementation that computes by default on an SM90 GPU with DeepGEMM installed.

    As ``kernels/moe.py`` chooses per call: FP8 experts take DeepGEMM where its
    operand rules hold (``H`` and ``I`` multiples of 128; the plan's weight
    blocks are 128 x 128), else the Triton grouped FP8 GEMM; bf16 experts take
    DeepGEMM's bf16 grouped GEMM (``CPGRAPH_BF16_EXPERTS=auto``) under the
    same operand rule, else ``torch._grouped_mm`` where the rows are 16-byte
    aligned, else the dense reference, as fp16 and fp32 experts do
    (``torch._grouped_mm`` takes bf16 on CUDA).  In the deterministic mode
    the experts are ``cpgraph::invariant_moe_experts``' Triton provider.
    A machine without DeepGEMM runs the experts as ``triton``: pass it.
    """
    H, two_i = cfg.hidden_size, 2 * cfg.moe_intermediate_size
    if deterministic:
        return "triton"
    deep_gemm_fits = H % 128 == 0 and two_i % 256 == 0
    if dtype == "fp8":
        return "deep_gemm" if deep_gemm_fits else "triton"
    if dtype in ("bf16", "bfloat16") and deep_gemm_fits:
        return "deep_gemm"
    if dtype in ("bf16", "bfloat16") and H % 8 == 0 and two_i % 16 == 0:
        return "triton"
    return "reference"


def _check_experts_provider(cfg, provider: str | None, dtype: str, deterministic: bool) -> str:
    """``provider`` (``None``: the default) if that code can compute these experts; else ValueError."""
    if provider is None:
        return default_experts_provider(cfg, dtype, deterministic)
    if provider not in EXPERTS_PROVIDERS:
        raise ValueError(f"plan_memory: argument 'experts_provider' must be one of {', '.join(EXPERTS_PROVIDERS)}, "
                         f"got {provider!r}")
    H, two_i = cfg.hidden_size, 2 * cfg.moe_intermediate_size
    why = None
    if provider == "reference" and dtype == "fp8":
        why = "the dense FP8 reference (one expert at a time, fp32 copies) is not modelled"
    elif provider in ("reference", "deep_gemm") and deterministic:
        why = "the deterministic mode computes the experts as cpgraph::invariant_moe_experts (provider 'triton')"
    elif provider == "triton" and not deterministic and dtype not in ("bf16", "bfloat16", "fp8"):
        why = f"{dtype} experts run the reference on CUDA (torch._grouped_mm takes bf16)"
    elif provider == "deep_gemm" and (dtype not in ("bf16", "bfloat16", "fp8") or H % 128 or two_i % 256):
        why = f"DeepGEMM takes bf16 activations with H and I multiples of 128, not {dtype} H={H}, 2I={two_i}"
    if why is not None:
        raise ValueError(f"plan_memory: argument 'experts_provider' {provider!r} does not apply: {why}")
    return provider
