"""The forward at production layer sizes on one GPU: time, useful FLOPs, where the GPU time goes, memory, projection.

Why this script: the kernel-shaped config of ``cuda_graph_bench.py`` (hidden 2048, 8 experts, top-2)
hides where a real model spends its time.  Here the layers have the released sizes:

* ``v32``: DeepSeek-V3.2 -- hidden 7168, 128 heads, q_lora 1536, kv_lora 512, rope 64, indexer
  64 x 128 with top-k 2048, 256 experts top-8 + 1 shared (moe 2048), dense intermediate 18432;
* ``glm5``: GLM-5 -- hidden 6144, 64 heads, q_lora 2048, qk_nope 192, v 256, indexer 32 x 128
  with top-k 2048, 256 experts top-8 + 1 shared (moe 2048), dense intermediate 12288; with
  IndexCache, so the stack has a layer that reuses the previous layer's top-k.

The stack has ``--layers`` (2-4) layers: layer 0 dense, the rest MoE; for GLM-5 the indexer
pattern is ``F S`` / ``F F S`` / ``F F S S`` (layer 0 always runs its own indexer).  Weights are
random, drawn ON the device in place (the model is built on the meta device, then allocated
there; no host copy), each matrix ~ N(0, fan_in^-1/2), norm gains ~ 1 + N(0, 0.05), embeddings
~ N(0, 1); the router weight, its correction bias and the indexer's ``weights_proj`` stay fp32 as
the checkpoints keep them.  FP8 weights are the same matrices quantised in place (e4m3, one
scale per 128 x 128 block, ``amax / 448``; ``kv_b_proj`` stays bf16 as the loader keeps it, routed
experts become ``FP8Experts``), activations quantised per token per 128 with power-of-two
scales (``scale_fmt: ue8m0``).  Random routing is close to uniform over experts: a best case for
the grouped GEMMs.

Variants (``--variants``, weights/KV): ``bf16/bf16``, ``fp8/bf16``, ``fp8/fp8``, ``bf16/fp8``
(FP8 KV = 656-byte MLA records + FP8 index-K pages, ``KVLayout(kv_format="fp8")``).
Cases (``--cases``): one request of 8K, 32K, 64K, 128K new tokens, and 8 requests x 4K (run in
the order 8K, 32K, 8x4K, 64K, 128K: the largest last).
Modes (``--modes``): ``compiled`` (``cpgraph.compile``, Inductor, ``dynamic=False``: one compile
per (variant, shape)), ``graphed`` (that compiled forward captured and replayed by
``GraphRunner`` with the case's exact shapes as its only bucket, so it does not compile again;
only for cases of at most ``--graph-max-tokens`` tokens: above that the forward is GPU-bound
and a second activation pool costs memory), optionally ``eager``.  ``--deterministic`` adds the mode
``deterministic``: the same model compiled a second time with ``CPConfig(deterministic=True)``
(docs/deterministic.md: row-invariant GEMMs, experts and combine, one Triton config per weight
shape), timed on the same batch and pools right after ``compiled``, with its ratio to it
(``deterministic / compiled``; the issue's target: at most 1.25 at 32K), its max |logit diff| to
the default forward, whether two of its calls give the same bits, and (``--profile``) its own
GPU-time breakdown.  It never counts as the case's best mode.

Per case and mode: median ms (CUDA events) and new tokens/s.  Per case (compiled forward):

* **useful FLOPs** (:func:`flops_parts`, multiply-add = 2; ``T`` new tokens, ``w_t`` the causal
  window of token ``t``, ``k = index_topk``), per layer::

      projections   T * 2 * (H*q_lora + q_lora*nh*(nope+rope) + H*(kv_lora+rope)
                             + nh*nope*kv_lora + nh*kv_lora*v + nh*v*H)        (absorbed MLA)
      sparse MLA    sum_t min(w_t, k) * 2 * nh * (576 + 512)     (kv_lora + rope, then kv_lora)
      indexer       T * 2 * (q_lora*ih*id + H*id + H*ih)  +  sum_t w_t * 2 * ih * id
                    (layers that run their own indexer only)
      dense MLP     T * 6 * H * intermediate
      MoE           T * (2 * H * E  +  (top_k + shared) * 6 * H * moe_intermediate)

  plus ``2 * H * vocab`` per request for the last-token logits.  This equals
  ``vs_transformers.forward_flops`` (checked on every run); TFLOP/s is set against a dense bf16
  GEMM (8192^3) and an FP8 GEMM (8192^3: the blockwise-scaled ``F.scaled_mm`` our FP8 linears
  use, where it runs; else per-tensor ``torch._scaled_mm``), both measured in the same run;
* **GPU-time breakdown** (``--profile``; one compiled forward under ``torch.profiler``): every
  kernel's time, grouped by name pattern (:data:`CATEGORIES`) into sparse attention, indexer
  select, indexer score, routed experts, query assembly, dense linears, other -- and
  ``unclassified``, whose top names are printed so nothing is hidden; all kernel names and
  times are in the JSON;
* **memory**: peak ``max_memory_allocated`` of the timed compiled runs (weights + KV pool +
  activations) against ``cpgraph memory``'s plan (:func:`cpgraph.plan.memory.plan_memory`, which
  models the EAGER forward, so for a compiled one it is an upper bound; 8 x 4K is planned as one
  request of 32K tokens, the same rows and keys).  The plan books the routed experts of the
  implementation that computed the case's ``moe_experts`` calls (the provider report's counts over
  the case: ``deep_gemm``, with its 128-row padded layout, or ``triton``), so the two compare like
  with like; the fit check before the run plans the default (DeepGEMM for FP8 experts);
* **per-layer times**: one more compiled forward with CUDA events recorded by the per-layer KV
  hooks (``cpgraph.ops.layer_events.layer_hooks``): ``kv_layer_ready`` (after the layer's q/kv
  projections) and ``kv_layer_written`` (after its KV write and indexer) split each layer into
  "KV write + indexer" and "sparse MLA + o_proj + MLP + the next layer's q/kv projections";
  the markers' order is checked (a reordered graph is reported, never used);
* **PROJECTION** of the whole model (61 layers for V3.2; 78 for GLM-5 with IndexCache
  ``index_topk_freq`` 4 / offset 3, i.e. 21 indexer layers): a layer of kind (MLP m, indexer f)
  costs the measured "attention + MLP" part of an m layer plus the "KV write + indexer" part of an
  f layer; the embedding, final norm and lm_head are counted once (timed apart, eager).  It
  is a projection, not a measurement: one GPU cannot hold the whole model; "ideal CP8" divides
  the time by 8 (no communication), so its per-GPU tokens/s equals the one-GPU figure.

Run on the GPU (the default -- V3.2, variants bf16/bf16, fp8/bf16, fp8/fp8, all five cases -- is 15
compiles plus about 90 s of forwards: an estimated 5-6 minutes; ``--quick``: 8K and 32K only)::

    python benchmarks/production_shape.py [--models v32,glm5] [--variants all] [--cases 8K,32K]
        [--modes compiled,graphed] [--layers 2] [--profile] [--quick] [--json out.json]

A step that fails (out of memory, a capture a provider refuses) is recorded in its row and
printed as ERROR, and the run goes on; the JSON is rewritten after every case.

``--device cpu``: a dry run of every code path at tiny sizes (kv_lora 512 and rope 64 kept,
which the 656-byte records need; top-k 32; the ``aot_eager`` backend unless ``--backend``; one
thread); its figures mean nothing.  Every variant and case kind, about 2-3 minutes on 2 cores::

    python benchmarks/production_shape.py --device cpu --models v32,glm5 --variants all \
        --cases 8K,8x4K --modes eager,compiled,graphed --profile
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import re
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gpu_state  # noqa: E402  (clocks, power and throttle reasons of each timed window)
import op_replay  # noqa: E402  (an op's provider replayed on the forward's own arguments)
import vs_transformers as vt  # noqa: E402  (timing, the dense GEMM, forward_flops, log)
from moe_bench import quantize_experts  # noqa: E402  (128 x 128 block quantisation of [E, N, K] stacks)

# ------------------------------------------------------------------ models
# The released architectures (public config.json facts; tests/models/test_real_configs.py holds the
# same dicts and tests/benchmarks/test_production_shape_dry.py checks these against them).
DEEPSEEK_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v32", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.44.2",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip
GLM5 = {
    "architectures": ["GlmMoeDsaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": [154820, 154827, 154829], "pad_token_id": 154820, "dtype": "bfloat16",
    "first_k_dense_replace": 3, "hidden_act": "silu", "head_dim": 64, "hidden_size": 6144, "index_head_dim": 128,
    "index_n_heads": 32, "index_topk": 2048, "initializer_range": 0.02, "intermediate_size": 12288,
    "kv_lora_rank": 512, "max_position_embeddings": 202752, "model_type": "glm_moe_dsa",
    "moe_intermediate_size": 2048, "n_group": 1, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 78,
    "num_key_value_heads": 64, "num_nextn_predict_layers": 1, "q_lora_rank": 2048, "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "noaux_tc", "v_head_dim": 256, "vocab_size": 154880,
}  # fmt: skip
# GLM-5's IndexCache schedule (three full layers, then one in four): 21 of its 78 layers run an indexer.
GLM5_INDEXCACHE = {"index_topk_freq": 4, "index_skip_topk_offset": 3}

MODELS = {
    "v32": ("DeepSeek-V3.2", DEEPSEEK_V32, {}),
    "glm5": ("GLM-5", GLM5, GLM5_INDEXCACHE),
}
# Indexer pattern of the benchmark stack per layer count (GLM-5 only; DeepSeek runs an indexer in every layer).
GLM_BENCH_INDEXERS = {2: ("full", "shared"), 3: ("full", "full", "shared"), 4: ("full", "full", "shared", "shared")}

# --device cpu: tiny sizes that keep what the code paths need (kv_lora 512 + rope 64 for the 656-byte
# records; index_head_dim a power of two <= 128 for FP8 index-K; dims multiples of the 128 x 128 block).
TINY = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, qk_nope_head_dim=32,
            v_head_dim=32, index_n_heads=4, index_head_dim=64, index_topk=32, n_routed_experts=16,
            num_experts_per_tok=4, moe_intermediate_size=128, intermediate_size=512, vocab_size=1024)  # fmt: skip


def real_config(model: str):
    """The released model's :class:`DSAConfig` (what the projection scales to)."""
    from cpgraph.models import DSAConfig

    _, d, extra = MODELS[model]
    return DSAConfig.from_hf_dict({**d, **extra})


def bench_config(model: str, layers: int, tiny: bool):
    """The benchmark stack: ``layers`` layers at the released sizes (layer 0 dense, the rest MoE)."""
    from cpgraph.models import DSAConfig

    if not 2 <= layers <= 4:
        raise ValueError(f"--layers must be 2, 3 or 4 (one dense layer, then MoE), got {layers}")
    _, d, _ = MODELS[model]
    d = {**d, "num_hidden_layers": layers, "mlp_layer_types": ["dense"] + ["sparse"] * (layers - 1)}
    if d["model_type"] == "glm_moe_dsa":
        d["indexer_types"] = list(GLM_BENCH_INDEXERS[layers])
    if tiny:
        d.update(TINY)
    return DSAConfig.from_hf_dict(d)


# ------------------------------------------------------------------ cases, variants
@dataclass(frozen=True)
class Case:
    name: str
    requests: int
    extend: int  # new tokens per request (one forward, no cached prefix)

    @property
    def tokens(self) -> int:
        return self.requests * self.extend


# The largest cases last: a failure that leaves the CUDA context unusable then costs the fewest results.
CASES = {c.name: c for c in (Case("8K", 1, 8192), Case("32K", 1, 32768), Case("8x4K", 8, 4096),
                             Case("64K", 1, 65536), Case("128K", 1, 131072))}  # fmt: skip
QUICK = ("8K", "32K")
TINY_EXTEND = {"8K": 64, "32K": 128, "64K": 192, "128K": 256, "8x4K": 32}  # --device cpu


@dataclass(frozen=True)
class Variant:
    weights: str  # "bf16" | "fp8"
    kv: str  # "bf16" | "fp8"

    @property
    def name(self) -> str:
        return f"{self.weights}/{self.kv}"


VARIANTS = {v.name: v for v in (Variant("bf16", "bf16"), Variant("fp8", "bf16"), Variant("fp8", "fp8"),
                                Variant("bf16", "fp8"))}  # fmt: skip
DEFAULT_VARIANTS = ("bf16/bf16", "fp8/bf16", "fp8/fp8")
MODES = ("eager", "compiled", "graphed", "deterministic")


# ------------------------------------------------------------------ weights on the device
def _fan_in_std(t: torch.Tensor) -> float:
    return t.shape[-1] ** -0.5  # [out, in] linears and [E, out, in] expert stacks


@torch.no_grad()
def init_weights_(model: nn.Module, seed: int) -> None:
    """Seeded random weights drawn in place on the model's device (sorted names: same seed, same weights).

    Matrices ~ N(0, fan_in^-1/2) so every projection keeps activations O(1) (real checkpoints are
    of that order); norm gains ~ 1 + N(0, 0.05); biases (the router's correction bias, the index
    key LayerNorm's bias) ~ N(0, 0.02); embeddings ~ N(0, 1) (the first RMSNorm rescales them).
    """
    g = torch.Generator(device=model.model.embed_tokens.weight.device).manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    for name in sorted(tensors):
        t = tensors[name]
        if name.endswith("inv_freq"):
            continue
        if re.search(r"norm\.weight$", name):
            t.normal_(1.0, 0.05, generator=g)
        elif name.endswith("bias"):
            t.normal_(0.0, 0.02, generator=g)
        elif name.endswith("embed_tokens.weight"):
            t.normal_(0.0, 1.0, generator=g)
        else:
            t.normal_(0.0, _fan_in_std(t), generator=g)


def build_random_model(cfg, device, seed: int = 0):
    """bf16 model (fp32 router / correction bias / weights_proj) allocated and initialised on ``device``.

    Built on the meta device first, so nothing is allocated before ``to_empty`` puts every tensor
    on ``device`` (cpgraph.models.init_random would draw fp32 on the host: 45 GB per V3.2 MoE layer).
    """
    from cpgraph.models import build_model
    from cpgraph.models.build import _materialize

    # The loader's own step: storage on the device, the RoPE table (computed, not drawn) rebuilt there.
    model = _materialize(build_model(cfg, torch.bfloat16, "meta"), cfg, device)
    init_weights_(model, seed)
    return model.eval()


FP8_KEPT_DENSE = ("kv_b_proj", "weights_proj")  # as cpgraph.models.fp8 keeps them (read as matrices / fp32)
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


@torch.no_grad()
def to_fp8_weights_(model) -> dict:
    """Quantise the model's projections in place (the FP8 checkpoints' format); returns what was converted.

    Every ``nn.Linear`` of the decoder layers except ``kv_b_proj`` and ``weights_proj`` becomes an
    ``FP8Linear``, every ``Experts`` an ``FP8Experts`` (``swap_fp8_linears``, the loader's own
    swap); embeddings and lm_head stay bf16, as in the released FP8 checkpoints.  One module at a
    time, so the bf16 and e4m3 copies of only one module coexist.
    """
    from cpgraph.models.config import FP8Quantization
    from cpgraph.models.fp8 import swap_fp8_linears
    from cpgraph.models.moe import Experts, FP8Experts

    quant = FP8Quantization(block=(128, 128), act_scale_pow2=True)
    # Names only: holding the modules would keep every bf16 weight alive until the end.
    targets = [(n, type(m) is nn.Linear) for n, m in model.named_modules() if n.startswith("model.layers.")
               and ((type(m) is nn.Linear and not n.endswith(FP8_KEPT_DENSE))
                    or (isinstance(m, Experts) and not isinstance(m, FP8Experts)))]  # fmt: skip
    linears = experts = 0
    for name, is_linear in targets:
        old = model.get_submodule(name)
        if is_linear:
            swap_fp8_linears(model, [name], quant)
            new = model.get_submodule(name)
            q, s = quantize_experts(old.weight[None])
            new.weight.data, new.weight_scale_inv.data = q[0], s[0]
            del q, s
            linears += 1
        else:
            n = old.num_experts
            swap_fp8_linears(model, [f"{name}.{j}.{p}" for j in range(n) for p in EXPERT_PROJS], quant)
            new = model.get_submodule(name)
            new.gate_up_proj.data, new.gate_up_proj_scale_inv.data = quantize_experts(old.gate_up_proj)
            new.down_proj.data, new.down_proj_scale_inv.data = quantize_experts(old.down_proj)
            experts += 1
        del old, new  # the bf16 tensors go here (reference counts: no cycles to collect)
    gc.collect()
    if vt.DEVICE == "cuda":
        torch.cuda.empty_cache()
    left = [n for n, m in model.named_modules() if n.startswith("model.layers.") and type(m) is nn.Linear
            and not n.endswith(FP8_KEPT_DENSE)]  # fmt: skip
    if left:
        raise RuntimeError(f"production_shape: linears left in bf16 after the FP8 conversion: {left[:4]}")
    return {"fp8_linears": linears, "fp8_expert_stacks": experts, "block": [128, 128], "act_scale_pow2": True}


def weight_bytes(model) -> int:
    from cpgraph.runtime.engine import weight_bytes_per_rank

    return weight_bytes_per_rank(model)


# ------------------------------------------------------------------ FLOPs
flops_parts = vt.flops_parts  # the one formula (benchmarks/vs_transformers.py)


# FLOPs behind each profile category (where one maps): achieved TFLOP/s per category.
CATEGORY_FLOPS = {
    "sparse attention": ("sparse_mla",),
    "indexer score": ("indexer_logits",),
    "routed experts": ("routed_experts",),
    "dense linears": ("projections", "indexer_projections", "dense_mlp", "router", "shared_experts", "lm_head"),
}


# ------------------------------------------------------------------ GEMM baselines
def gemm_baselines(repeat: int = 10) -> dict:
    """Same-run GEMM rates (TFLOP/s) the forward's FLOP rate is set against: bf16, FP8 per-tensor, FP8 blockwise."""
    cuda = vt.DEVICE == "cuda"
    n = 8192 if cuda else 256
    out = {"n": n, "bf16_tflops": vt.dense_gemm_tflops(n, repeat)}
    a = torch.randn(n, n, device=vt.DEVICE).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=vt.DEVICE).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm takes it
    one = torch.ones((), device=vt.DEVICE)
    try:
        ms = vt.time_ms(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), repeat, warmup=3)
        out["fp8_tensorwise_tflops"] = 2 * n**3 / (ms * 1e-3) / 1e12
    except RuntimeError as exc:  # recorded and printed; the FP8 share then uses the blockwise GEMM alone
        out["fp8_tensorwise_tflops"] = None
        out["fp8_tensorwise_skipped"] = _failure(exc)
    del a, b
    from cpgraph.kernels.fp8_linear import quantize_activations, scaled_mm_gemm, scaled_mm_reason

    x = torch.randn(n, n, device=vt.DEVICE, dtype=torch.bfloat16)
    wq, ws = quantize_experts((torch.randn(n, n, device=vt.DEVICE) * n**-0.5)[None])
    why = scaled_mm_reason(x, wq[0], 128, 128)
    if why is None:
        xq, xs = quantize_activations(x, 128, True, scales_column_major=True)
        ms = vt.time_ms(lambda: scaled_mm_gemm(xq, xs, wq[0], ws[0], torch.bfloat16), repeat, warmup=3)
        out["fp8_blockwise_tflops"] = 2 * n**3 / (ms * 1e-3) / 1e12
        del xq, xs
    else:
        out["fp8_blockwise_tflops"] = None
        out["fp8_blockwise_skipped"] = why
    del x, wq, ws
    blockwise = out["fp8_blockwise_tflops"]
    out["fp8_tflops"] = blockwise if blockwise is not None else out["fp8_tensorwise_tflops"]
    out["fp8_reference"] = ("blockwise F.scaled_mm (1x128 / 128x128)" if blockwise is not None
                            else "torch._scaled_mm per-tensor" if out["fp8_tflops"] else "none ran")  # fmt: skip
    return out


# ------------------------------------------------------------------ profile breakdown
# Ordered (first match wins) name patterns: CUDA kernel names, plus the CPU op names the dry run sees.
CATEGORIES = (
    ("sparse attention", r"sparse_mla|flash_?mla|sparse_attn|sparse_fwd|sparse_prefill|splitkv_mla|mla_fwd|fwd_mla"),
    ("indexer select", r"_select_kernel|topk_select|select_topk|radix_select|indexer_select"),
    ("indexer score", r"_score_kernel|mqa_logits|indexer_logits|cpgraph::indexer_topk"),
    ("routed experts", r"(?i)group(ed)?_?(mm|gemm)|GroupProblemShape|_swiglu_quant_kernel|_combine_kernel"
                       r"|cpgraph::(invariant_)?moe_experts|^_grouped_kernel$|deep_gemm::GemmType\)[125]\b"),
    ("query assembly", r"^triton_\w*fused\w*_cat"),
    # _quantize_kernel also names _rms_norm_quantize_kernel: the residual add + norm that quantises for the FP8
    # projections (its bf16 forward counterpart, Inductor's add + norm, is "other")
    ("dense linears", r"(?i)nvjet|gemm|gemv|xmma|cutlass|cublas|scaled_mm|_quantize_kernel"
                      r"|aten::(mm|addmm|bmm|matmul|linear)$|cpgraph::fp8_block_linear|cpgraph::invariant_(mm|fp8_linear)"
                      r"|^_mm_kernel$"),
    ("other", r"(?i)elementwise|reduce|^triton_(poi|per|red)_|index|scatter|gather|sort|topk|copy|memcpy|memset"
              r"|fill|cat|norm|softmax|_move_rows|_pack_kernel|_unpack_kernel|_store_kernel|_segments_kernel"
              r"|_valid_scan|hadamard|_moe_route_kernel|^cpgraph::|^aten::"),
)
UNCLASSIFIED = "unclassified"
_CATEGORY_RE = [(name, re.compile(p)) for name, p in CATEGORIES]


def classify(kernel: str) -> str:
    """The breakdown category of one kernel (or CPU op) name; ``unclassified`` if no pattern matches."""
    for name, pattern in _CATEGORY_RE:
        if pattern.search(kernel):
            return name
    return UNCLASSIFIED


def breakdown(kernels: list[tuple[str, float, int]], parts: dict[str, float] | None = None) -> dict:
    """Group ``(name, ms, calls)`` rows by :func:`classify`; TFLOP/s where a category has FLOPs; top names."""
    busy = sum(ms for _, ms, _ in kernels)
    cats: dict[str, dict] = {}
    for name, ms, calls in sorted(kernels, key=lambda k: -k[1]):
        c = cats.setdefault(classify(name), {"ms": 0.0, "calls": 0, "top": []})
        c["ms"] += ms
        c["calls"] += calls
        if len(c["top"]) < 8:
            c["top"].append({"kernel": name[:160], "ms": ms, "calls": calls})
    order = [n for n, _ in CATEGORIES] + [UNCLASSIFIED]
    out = {}
    for name in order:
        if name not in cats:
            continue
        c = cats[name]
        c["share"] = c["ms"] / busy if busy else 0.0
        flops = sum(parts[p] for p in CATEGORY_FLOPS.get(name, ())) if parts else 0.0
        c["tflops"] = flops / (c["ms"] * 1e-3) / 1e12 if flops and c["ms"] > 0 else None
        out[name] = c
    return {"gpu_busy_ms": busy, "categories": out}


def profile_forward(fn, parts: dict[str, float]) -> dict:
    """One call of ``fn`` under ``torch.profiler``: every kernel's time (CUDA) or every op's self time (CPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = vt.DEVICE == "cuda"
    vt.sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        vt.sync()
        wall = (time.perf_counter() - t0) * 1e3
    rows = []
    for e in prof.key_averages():
        if cuda:
            if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(e, "device_time_total", None)
            us = e.cuda_time_total if us is None else us
        else:
            us = e.self_cpu_time_total
        if us > 0:
            rows.append((e.key, us / 1e3, e.count))
    out = breakdown(rows, parts)
    out.update(wall_ms=wall, source="CUDA kernels" if cuda else "CPU ops, self time (dry run)",
               kernels=[{"kernel": n, "ms": ms, "calls": c, "category": classify(n)}
                        for n, ms, c in sorted(rows, key=lambda r: -r[1])])  # fmt: skip
    return out


# ------------------------------------------------------------------ per-layer times and the projection
class Clock:
    """Stream-ordered time stamps: CUDA events on the GPU, ``perf_counter`` on the CPU (synchronous)."""

    def __init__(self):
        self.cuda = vt.DEVICE == "cuda"

    def stamp(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def layer_segments(fn, num_layers: int) -> dict:
    """Split one forward at each layer's ``kv_layer_ready`` / ``kv_layer_written`` marker (see the docstring).

    ``kv_write_indexer_ms[i]``: ready(i) -> written(i); ``attention_mlp_ms[i]``: written(i) ->
    ready(i + 1) (the last: -> the end of the forward); ``pre_ms``: start -> ready(0).
    """
    from cpgraph.ops.layer_events import layer_hooks

    clock = Clock()
    marks: list[tuple[str, int, object]] = []
    with layer_hooks(on_ready=lambda layer, pool: marks.append(("ready", layer, clock.stamp())),
                     on_written=lambda layer, pool: marks.append(("written", layer, clock.stamp()))):  # fmt: skip
        start = clock.stamp()
        fn()
        end = clock.stamp()
    vt.sync()
    total = clock.ms(start, end)
    got = [(k, layer) for k, layer, _ in marks]
    want = [(k, i) for i in range(num_layers) for k in ("ready", "written")]
    at = [clock.ms(start, s) for _, _, s in marks]
    if got != want or any(b < a for a, b in zip(at, at[1:])):
        return {"ok": False, "why": f"layer markers out of order or missing: {got} at {[round(t, 3) for t in at]} ms",
                "total_ms": total}  # fmt: skip
    ready, written = at[0::2], at[1::2]
    return {
        "ok": True,
        "total_ms": total,
        "pre_ms": ready[0],
        "kv_write_indexer_ms": [w - r for r, w in zip(ready, written)],
        "attention_mlp_ms": [nxt - w for w, nxt in zip(written, ready[1:] + [total])],
    }


def once_ms(model, ids, meta, repeat: int) -> float:
    """The parts a forward runs once, eagerly: embedding, RoPE tables, last rows, final norm, lm_head."""
    body = model.model
    take = torch.ops.cpgraph.take_rows

    def once():
        x = body.embed_tokens(ids)
        body.rotary(meta.positions, x.dtype)
        return model.lm_head(body.norm(take(x, meta.last_token_index))).float()

    return vt.time_ms(once, repeat, warmup=1)


def project(bench_cfg, real, seg: dict, once: float, case: Case, measured_ms: float) -> dict:
    """Full-model prefill time from the per-layer segments (a PROJECTION; see the module docstring)."""
    label = (f"PROJECTION, not a measurement: {real.num_hidden_layers} layers on one GPU (which cannot hold "
             "them) from this run's per-layer times; ideal CP8 = that time / 8, no communication")  # fmt: skip
    counts = Counter(zip(real.mlp_layer_types, real.indexer_types))
    out = {"label": label, "layers": real.num_hidden_layers,
           "layer_kinds": {f"{m}/{f}": n for (m, f), n in sorted(counts.items())}}  # fmt: skip
    if not seg.get("ok"):
        out["skipped"] = f"no per-layer times: {seg.get('why')}"
        return out
    L = bench_cfg.num_hidden_layers
    idx, rest = seg["kv_write_indexer_ms"], seg["attention_mlp_ms"]
    # The last layer's q/kv projections sit in pre_ms (before layer 0's first marker), and its segment
    # ends with the final norm and lm_head: take the once-only parts out there.
    layer_ms = [idx[i] + rest[i] for i in range(L - 1)] + [idx[L - 1] + rest[L - 1] + seg["pre_ms"] - once]
    by_index: dict[str, list[float]] = {}
    by_mlp: dict[str, list[float]] = {}
    for i in range(L):
        by_index.setdefault(bench_cfg.indexer_types[i], []).append(idx[i])
        by_mlp.setdefault(bench_cfg.mlp_layer_types[i], []).append(layer_ms[i] - idx[i])
    missing = sorted({f"mlp {m}" for m, _ in counts if m not in by_mlp}
                     | {f"indexer {f}" for _, f in counts if f not in by_index})
    if missing:
        out["skipped"] = f"the benchmark stack has no layer of kind {', '.join(missing)}"
        return out
    kind_ms = {f"{m}/{f}": statistics.fmean(by_mlp[m]) + statistics.fmean(by_index[f]) for m, f in counts}
    total_ms = once + sum(n * kind_ms[f"{m}/{f}"] for (m, f), n in counts.items())
    tokens = case.tokens
    parts_real = vt.forward_flops(real, case.requests, case.extend, 0)
    parts_bench = vt.forward_flops(bench_cfg, case.requests, case.extend, 0)
    out.update(
        once_ms=once, layer_ms=layer_ms, kind_ms=kind_ms, full_model_s=total_ms / 1e3,
        tokens_per_s_one_gpu=tokens / (total_ms * 1e-3),
        cp8_ideal_latency_s=total_ms / 8e3, cp8_ideal_tokens_per_s_per_gpu=tokens / (total_ms * 1e-3),
        full_model_tflop=parts_real / 1e12,
        # Cross-check only: the measured time scaled by the FLOP ratio of the real stack and this one.
        flop_scaled_s=measured_ms * parts_real / parts_bench / 1e3,
    )  # fmt: skip
    return out


# ------------------------------------------------------------------ one case
def _oom_types():
    kinds = (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
    return tuple(t for t in kinds if t)


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _failure(exc: BaseException) -> str:
    kind = "out of memory" if isinstance(exc, _oom_types()) else type(exc).__name__
    return f"{kind}: {(str(exc).splitlines() or [''])[0][:300]}"


def _guarded(store: dict, key: str, what: str, step):
    """Run one measurement step; a failure is recorded under ``store[key]`` and logged, and the run goes on.

    Why: the GPU run has minutes of device time, so one step that fails (an OOM at 128K, a capture
    that a provider refuses) must not lose the cases after it.  Nothing is retried or replaced.
    """
    try:
        return step()
    except Exception as exc:  # noqa: BLE001 - recorded, printed, never hidden
        store[key] = {"error": _failure(exc)}
        vt.log(f"  ERROR {what}: {store[key]['error']}")
        vt.reset_peak()
        return None


def _experts_ran(before: dict, after: dict) -> str | None:
    """The ``cpgraph::moe_experts`` implementation that computed most calls between two provider reports (``calls``)."""

    def counts(report: dict) -> Counter:
        out: Counter = Counter()
        for r in report.get("moe_experts", []):  # one row per (implementation, reason)
            out[r["implementation"]] += r["calls"]
        return out

    ran = counts(after) - counts(before)  # the counts only grow: what is left ran in between
    return ran.most_common(1)[0][0] if ran else None


def _plan_row(plan) -> dict:
    return {"weights": plan.weight_bytes, "kv": plan.kv_bytes, "activation_peak": plan.activation_peak,
            "peak_phase": plan.peak_phase, "total": plan.total_bytes, "experts_provider": plan.experts_provider}


def time_mode(fn, tokens: int, repeat: int, warmup: int, gpu=None) -> dict:
    """First call (compiles a compiled forward), then the median of ``repeat`` timed calls; peak memory.

    ``gpu`` (a running :class:`gpu_state.GpuState`): the clocks, power and throttle reasons of the timed calls.
    """
    cuda = vt.DEVICE == "cuda"
    vt.reset_peak()
    base = torch.cuda.memory_allocated() if cuda else 0
    before = unique_graphs()
    t0 = time.perf_counter()
    fn()
    vt.sync()
    first_s = time.perf_counter() - t0
    compiles = unique_graphs() - before
    vt.reset_peak()
    t0 = time.perf_counter()
    ms = vt.time_ms(fn, repeat, warmup=warmup)
    out = {"ms": ms, "tokens_per_s": tokens / (ms * 1e-3), "first_call_s": first_s, "graphs_compiled": compiles,
           "repeat": repeat}  # fmt: skip
    if gpu is not None and gpu.available:
        out["gpu"] = gpu.window(t0, time.perf_counter())
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        out.update(peak_bytes=peak, activation_peak_bytes=peak - base)
    return out


def time_graphed(compiled, compiled_fn, pools, prompts, tables, case: Case, rows: int, kv_rows: int, page: int,
                 repeat: int, warmup: int, state: dict) -> dict:
    """The compiled forward captured by a ``GraphRunner`` whose one bucket is this case's exact shapes."""
    from cpgraph.models import build_batch
    from cpgraph.runtime.graph_runner import GraphRunner

    mla, index = pools
    B, E = case.requests, case.extend
    runner = state["runner"] = GraphRunner(lambda i, m: compiled(i, m, mla, index).logits, max_requests=B,
                                           row_buckets=(rows,), kv_buckets=(kv_rows,), warmup_calls=1)  # fmt: skip
    device = mla[0].device
    gids, gmeta = build_batch(runner.plan([0] * B, [E] * B, page), prompts, tables, device)
    before = unique_graphs()
    ref = compiled_fn().float() if compiled_fn is not None else None
    got = runner(gids, gmeta).float()  # warm-up and capture (not timed)
    ms = vt.time_ms(lambda: runner(gids, gmeta), repeat, warmup=warmup)
    return {"ms": ms, "tokens_per_s": case.tokens / (ms * 1e-3), "repeat": repeat, "capture": runner.capture_report(),
            "graphs_compiled": unique_graphs() - before,
            "max_abs_diff_vs_compiled": None if ref is None else (got - ref).abs().max().item()}  # fmt: skip


def time_deterministic(compiled, default_fn, fn, tokens: int, repeat: int, warmup: int, default_ms,
                       parts: dict | None) -> dict:
    """The deterministic compile on the case's batch: time, ratio to the default, numerics, repeat bits, profile."""
    out = time_mode(fn, tokens, repeat, warmup)
    out["vs_compiled"] = out["ms"] / default_ms if default_ms else None
    a = fn().float()
    out["repeat_bitwise"] = bool(torch.equal(a, fn().float()))
    out["max_abs_diff_vs_compiled"] = (a - default_fn().float()).abs().max().item()
    if parts is not None:
        out["profile"] = profile_forward(fn, parts)
    return out


@torch.no_grad()
def run_case(model, compiled, cfg, real, variant: Variant, case: Case, args, gemm: dict, deterministic=None) -> dict:
    """Every measurement of one (variant, case): see the module docstring (``deterministic``: that compile)."""
    from cpgraph.models import build_batch
    from cpgraph.ops.providers import calls
    from cpgraph.plan import plan_prefill
    from cpgraph.plan.memory import plan_memory
    from cpgraph.runtime.engine import pool_config, pool_tensors
    from cpgraph.runtime.kv_pool import KVPool

    cuda = vt.DEVICE == "cuda"
    B, E, page = case.requests, case.extend, args.page
    tokens = case.tokens
    row = {"model": args.model_key, "variant": variant.name, "case": case.name, "requests": B, "new_tokens": E,
           "tokens": tokens}  # fmt: skip
    parts = flops_parts(cfg, B, E, 0)
    flops = sum(parts.values())
    row["forward_tflop"] = flops / 1e12
    row["flops_parts_tflop"] = {k: v / 1e12 for k, v in parts.items()}
    # The plan's default experts are an SM90 GPU's with DeepGEMM; a CPU run computes the grouped path ("triton").
    plan = plan_memory(cfg, tokens=tokens, dtype=variant.weights, kv_format=variant.kv, page_size=page,
                       max_logits_bytes=model.kv_layout.max_logits_bytes,
                       experts_provider=None if vt.DEVICE == "cuda" else "triton")
    row["memory_plan"] = _plan_row(plan)
    experts_before = calls(vt.DEVICE)  # which moe_experts implementation computes this case: the counts' growth
    vt.reset_peak()  # return the previous case's cached blocks before asking what is free
    if cuda:
        free, _ = torch.cuda.mem_get_info()
        # The plan models the eager forward; a compiled one needed about 0.63x its activations on an H200.
        need = plan.kv_bytes + int(args.compiled_activation_fraction * plan.activation_peak)
        if need > free:
            row["skipped"] = (f"does not fit: KV + {args.compiled_activation_fraction:.2f} x the planned activation peak "
                              f"= {need / 2**30:.1f} GiB > {free / 2**30:.1f} GiB free")  # fmt: skip
            vt.log(f"  skip {case.name}: {row['skipped']}")
            return row
    g = torch.Generator().manual_seed(args.seed + 1)
    prompts = [torch.randint(0, cfg.vocab_size, (E,), generator=g).tolist() for _ in range(B)]
    pages = [math.ceil(E / page)] * B
    big = tokens > 32768
    repeat = max(2, args.repeat * 32768 // tokens + 1) if big else args.repeat
    warmup = 0 if big else 1  # the first call already ran the whole forward once
    state: dict = {}
    modes: dict = {}
    row["modes"] = modes
    try:
        pool = state["pool"] = KVPool(pool_config(model, variant.kv, page, sum(pages)))
        tables = [pool.alloc_pages_with_owners([0] * n) for n in pages]
        mla, index = state["pools"] = pool_tensors(pool, model)
        for t in mla + index:
            torch._dynamo.mark_static_address(t)  # a captured graph binds the pool's addresses
        plan_batch = plan_prefill([0] * B, [E] * B, cp_size=1, page_size=page)
        ids, meta = build_batch(plan_batch, prompts, tables, model.device)
        state["batch"] = (ids, meta)
        row["rows"], row["kv_rows"] = int(ids.shape[0]), int(meta.kv_source.shape[0])
        row["memory"] = {"weights": weight_bytes(model), "kv_pool": pool.total_bytes()}
        compiled_fn = lambda: compiled(ids, meta, mla, index).logits  # noqa: E731
        eager_fn = lambda: model(ids, meta, mla, index).logits  # noqa: E731
        for mode in [m for m in ("eager", "compiled") if m in args.modes_list]:
            fn = compiled_fn if mode == "compiled" else eager_fn
            got = _guarded(modes, mode, f"{case.name} {mode}",
                           lambda fn=fn: time_mode(fn, tokens, repeat, warmup, args.gpu_state))
            if got is not None:
                modes[mode] = got
                clocks = f"; {gpu_state.describe(got['gpu'])}" if "gpu" in got else ""
                vt.log(f"  {case.name} {mode}: {got['ms']:.2f} ms, {got['tokens_per_s']:,.0f} tok/s, first call "
                       f"{got['first_call_s']:.1f} s ({got['graphs_compiled']} graph(s) compiled){clocks}")  # fmt: skip
        if "ms" in modes.get("compiled", {}):
            seg = _guarded(row, "layer_segments", f"{case.name} per-layer times",
                           lambda: layer_segments(compiled_fn, cfg.num_hidden_layers))
            once = _guarded(row, "once_ms", f"{case.name} embed/head time", lambda: once_ms(model, ids, meta, repeat))
            if seg is not None:
                row["layer_segments"] = seg
                if not seg["ok"]:
                    vt.log(f"  WARNING {case.name}: {seg['why']}; no projection")
                if once is not None:
                    row["projection"] = proj = project(cfg, real, seg, once, case, modes["compiled"]["ms"])
                    if "full_model_s" in proj:  # logged as it comes: a run cut short keeps it in its log
                        vt.log(f"  {case.name} projection ({proj['layers']} layers): {proj['full_model_s']:.2f} s one "
                               f"GPU, {proj['cp8_ideal_tokens_per_s_per_gpu']:,.0f} tok/s/GPU ideal CP8")  # fmt: skip
            if args.profile:
                prof = _guarded(row, "profile", f"{case.name} profile", lambda: profile_forward(compiled_fn, parts))
                if prof is not None:
                    row["profile"] = prof
                    vt.log(f"  {case.name} profile: busy {prof['gpu_busy_ms']:.1f} ms of {prof['wall_ms']:.1f} ms wall; "
                           + ", ".join(f"{k} {v['ms']:.1f}" for k, v in prof["categories"].items()))  # fmt: skip
            for op in args.replay_list:
                got = _guarded(row.setdefault("replay", {}), op, f"{case.name} replay of {op}", lambda op=op: op_replay.replay_op(
                    compiled_fn, op, vt.DEVICE, repeat=args.repeat, rest_s=args.replay_rest, state=args.gpu_state))  # fmt: skip
                if got is not None:
                    row["replay"][op] = got
                    vt.log(f"  {case.name} " + op_replay.describe(got, gpu_state.describe))
        if deterministic is not None:
            det = _guarded(modes, "deterministic", f"{case.name} deterministic", lambda: time_deterministic(
                deterministic, compiled_fn, lambda: deterministic(ids, meta, mla, index).logits, tokens, repeat, warmup,
                modes.get("compiled", {}).get("ms"), parts if args.profile else None))  # fmt: skip
            if det is not None:
                # Its own plan: in the deterministic mode the fp32 products copy x to fp32 (plan_memory's flag).
                dplan = plan_memory(cfg, tokens=tokens, dtype=variant.weights, kv_format=variant.kv, page_size=page,
                                    max_logits_bytes=model.kv_layout.max_logits_bytes, deterministic=True)
                det["memory_plan"] = {"activation_peak": dplan.activation_peak, "peak_phase": dplan.peak_phase,
                                      "total": dplan.total_bytes}
                if "peak_bytes" in det:
                    det["peak_over_plan"] = det["peak_bytes"] / dplan.total_bytes
                modes["deterministic"] = det
                ratio = _fmt(det["vs_compiled"], ".3f")
                vt.log(f"  {case.name} deterministic: {det['ms']:.2f} ms = {ratio} x compiled, |d| vs compiled "
                       f"{det['max_abs_diff_vs_compiled']:.3g}, repeat bit-identical {det['repeat_bitwise']}")
        if "graphed" in args.modes_list:
            if tokens > args.graph_max_tokens:
                modes["graphed"] = {"skipped": f"{tokens} tokens > --graph-max-tokens {args.graph_max_tokens} "
                                               "(GPU-bound; the graph pool would hold a second activation set)"}
            else:
                ref_fn = compiled_fn if "ms" in modes.get("compiled", {}) else None
                got = _guarded(modes, "graphed", f"{case.name} graphed", lambda: time_graphed(
                    compiled, ref_fn, (mla, index), prompts, tables, case, row["rows"], row["kv_rows"], page, repeat,
                    warmup, state))  # fmt: skip
                if got is not None:
                    modes["graphed"] = got
                    cap = got["capture"][0]
                    vt.log(f"  {case.name} graphed: {got['ms']:.2f} ms ({got['graphs_compiled']} graph(s) compiled, "
                           f"capture {cap['capture_s']:.2f} s, pool {cap['pool_mib']:.0f} MiB)")  # fmt: skip
        timed = {k: v for k, v in modes.items() if "ms" in v and k != "deterministic"}
        if timed:
            best = min(timed, key=lambda k: timed[k]["ms"])
            ms = timed[best]["ms"]
            row.update(best_mode=best, ms=ms, tokens_per_s=tokens / (ms * 1e-3), tflops=flops / (ms * 1e-3) / 1e12)
            row["share_of_bf16_gemm"] = row["tflops"] / gemm["bf16_tflops"]
            row["share_of_fp8_gemm"] = row["tflops"] / gemm["fp8_tflops"] if gemm.get("fp8_tflops") else None
        else:
            row["skipped"] = "no mode ran: " + "; ".join(f"{k}: {v.get('error') or v.get('skipped')}"
                                                        for k, v in modes.items())  # fmt: skip
        c = modes.get("compiled", {})
        if "peak_bytes" in c:
            ran = _experts_ran(experts_before, calls(vt.DEVICE))
            if ran is not None and ran != plan.experts_provider:  # plan the experts that ran (e.g. no DeepGEMM)
                try:
                    plan = plan_memory(cfg, tokens=tokens, dtype=variant.weights, kv_format=variant.kv,
                                       page_size=page, max_logits_bytes=model.kv_layout.max_logits_bytes,
                                       experts_provider=ran)
                    row["memory_plan"] = _plan_row(plan)
                except ValueError as exc:  # an implementation the plan does not model (the FP8 reference)
                    row["memory_plan"]["experts_ran"] = f"{ran} (not planned: {exc})"
            row["memory"].update(peak=c["peak_bytes"], activation_peak=c["activation_peak_bytes"],
                                 peak_over_plan=c["peak_bytes"] / plan.total_bytes,
                                 activation_over_plan=c["activation_peak_bytes"] / max(plan.activation_peak, 1),
                                 weights_over_plan=row["memory"]["weights"] / plan.weight_bytes)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the pool or the batch could not be built: recorded, the run goes on
        row["skipped"] = _failure(exc)
        vt.log(f"  ERROR {case.name}: {row['skipped']}")
    finally:
        state.clear()
    return row


# ------------------------------------------------------------------ output
def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.1f}"


def _fmt(x, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def print_tables(results: list[dict], meta: dict) -> None:
    gemm = meta["gemm"]
    print(f"\nproduction_shape on {meta['device']}: same-run dense bf16 GEMM {gemm['bf16_tflops']:.0f} TFLOP/s, "
          f"FP8 GEMM {_fmt(gemm['fp8_tflops'], '.0f')} TFLOP/s ({gemm['fp8_reference']})")  # fmt: skip
    hdr = (f"{'model':<6}{'variant':<10}{'case':<6}{'mode':<9}{'ms':>10}{'tok/s':>10}{'TFLOP':>8}{'TFLOP/s':>9}"
           f"{'%bf16':>7}{'%fp8':>6}{'peak GiB':>9}{'plan GiB':>9}{'proj s':>8}{'proj tok/s/GPU':>15}")  # fmt: skip
    print(hdr)
    for r in results:
        head = f"{r['model']:<6}{r['variant']:<10}{r['case']:<6}"
        if "ms" not in r:
            print(f"{head}skipped: {r.get('skipped', 'no timed mode')}")
            continue
        p = r.get("projection", {})
        proj_s = f"{p['full_model_s']:.2f}" if "full_model_s" in p else "-"
        proj_t = f"{p['cp8_ideal_tokens_per_s_per_gpu']:,.0f}" if "full_model_s" in p else "-"
        mem = r.get("memory", {})
        print(f"{head}{r['best_mode']:<9}{r['ms']:>10.2f}{r['tokens_per_s']:>10,.0f}{r['forward_tflop']:>8.1f}"
              f"{r['tflops']:>9.0f}{100 * r['share_of_bf16_gemm']:>6.1f}%{_fmt(r['share_of_fp8_gemm'], '.1f', 100):>5}%"
              f"{_gib(mem.get('peak')):>9}{_gib(r['memory_plan']['total']):>9}{proj_s:>8}{proj_t:>15}")  # fmt: skip
    print("(proj: PROJECTION of the full model from this run's per-layer times, one GPU; tok/s/GPU under ideal CP8)")
    det_rows = [r for r in results if "ms" in r.get("modes", {}).get("deterministic", {})]
    if det_rows:
        print("\ndeterministic (CPConfig(deterministic=True)) vs the default compile, same run (target <= 1.25x at 32K)")
        print(f"{'model':<6}{'variant':<10}{'case':<6}{'default ms':>11}{'det ms':>10}{'ratio':>7}{'|d| logits':>12}"
              f"{'repeat bits':>12}")
        for r in det_rows:
            d, c = r["modes"]["deterministic"], r["modes"].get("compiled", {})
            print(f"{r['model']:<6}{r['variant']:<10}{r['case']:<6}{_fmt(c.get('ms'), '.2f'):>11}{d['ms']:>10.2f}"
                  f"{_fmt(d['vs_compiled'], '.3f'):>7}{d['max_abs_diff_vs_compiled']:>12.3g}{str(d['repeat_bitwise']):>12}")
            prof = d.get("profile")
            if prof and "categories" in prof:
                print("    GPU time: " + ", ".join(f"{k} {v['ms']:.1f} ms" for k, v in prof["categories"].items()))
    print("\nper mode: ms (first call s, graphs compiled)")
    for r in results:
        for m, v in r.get("modes", {}).items():
            if "ms" in v:
                extra = f"first {v['first_call_s']:.1f} s" if "first_call_s" in v else (
                    f"capture {v['capture'][0]['capture_s']:.2f} s, pool {v['capture'][0]['pool_mib']:.0f} MiB, "
                    f"|d| vs compiled {v['max_abs_diff_vs_compiled']}")  # fmt: skip
                print(f"  {r['model']:<5} {r['variant']:<9} {r['case']:<5} {m:<9}{v['ms']:>10.2f} ms  {extra}, "
                      f"{v['graphs_compiled']} graph(s)")  # fmt: skip
            else:
                why = v.get("skipped") or f"ERROR {v.get('error')}"
                print(f"  {r['model']:<5} {r['variant']:<9} {r['case']:<5} {m:<9} {why}")
    for r in results:
        seg, p = r.get("layer_segments"), r.get("projection", {})
        if seg and seg.get("ok"):
            per = "; ".join(f"L{i} {a:.1f}+{b:.1f}" for i, (a, b) in
                            enumerate(zip(seg["kv_write_indexer_ms"], seg["attention_mlp_ms"])))  # fmt: skip
            print(f"\nlayers {r['model']} {r['variant']} {r['case']} (KV write + indexer, then attention + MLP, ms): "
                  f"pre {seg['pre_ms']:.1f}; {per}; once-only {p.get('once_ms', 0):.2f}")  # fmt: skip
            if "kind_ms" in p:
                kinds = ", ".join(f"{k} {v:.1f} ms x {p['layer_kinds'][k]}" for k, v in p["kind_ms"].items())
                print(f"  projection ({p['layers']} layers): {kinds} -> {p['full_model_s']:.2f} s one GPU, "
                      f"{p['cp8_ideal_latency_s']:.2f} s ideal CP8, {p['cp8_ideal_tokens_per_s_per_gpu']:,.0f} tok/s/GPU "
                      f"(FLOP-scaled cross-check {p['flop_scaled_s']:.2f} s)")  # fmt: skip
            elif "skipped" in p:
                print(f"  projection skipped: {p['skipped']}")
        elif seg and "why" in seg:
            print(f"\nlayers {r['model']} {r['variant']} {r['case']}: no per-layer times ({seg['why']}), no projection")
        for key in ("layer_segments", "once_ms", "profile"):
            if isinstance(r.get(key), dict) and "error" in r[key]:
                print(f"  {r['model']} {r['variant']} {r['case']} {key}: ERROR {r[key]['error']}")
        prof = r.get("profile")
        if prof and "categories" in prof:
            print(f"  GPU time ({prof['source']}): busy {prof['gpu_busy_ms']:.1f} ms, wall {prof['wall_ms']:.1f} ms")
            for name, c in prof["categories"].items():
                tf = f"{c['tflops']:.0f} TFLOP/s" if c["tflops"] else ""
                print(f"    {name:<18}{c['ms']:>10.2f} ms {100 * c['share']:>5.1f}%  x{c['calls']:<6}{tf}")
                if name in ("unclassified", "other"):
                    for k in c["top"][:5]:
                        print(f"        {k['ms']:>9.2f} ms  {k['kernel'][:110]}")
        mem, plan = r.get("memory", {}), r.get("memory_plan")
        if mem.get("peak") is not None:
            print(f"  memory: peak {_gib(mem['peak'])} GiB vs plan {_gib(plan['total'])} GiB "
                  f"({mem['peak_over_plan']:.2f}x); activations {_gib(mem['activation_peak'])} vs "
                  f"{_gib(plan['activation_peak'])} GiB ({mem['activation_over_plan']:.2f}x, plan = eager, "
                  f"{plan['peak_phase']}, experts {plan.get('experts_provider')}); weights "
                  f"{mem['weights_over_plan']:.3f}x")  # fmt: skip


def write_json(path, meta, results) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"meta": meta, "cases": results}, indent=1, default=str))


# ------------------------------------------------------------------ main
def _split(v: str) -> list[str]:
    return [x.strip() for x in v.split(",") if x.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="v32", help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"weights/KV, comma list of {', '.join(VARIANTS)}, or 'all'")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--quick", action="store_true", help=f"cases {', '.join(QUICK)} only")
    ap.add_argument("--modes", default="compiled,graphed", help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--layers", type=int, default=2, help="layers of the stack, 2-4 (layer 0 dense, the rest MoE)")
    ap.add_argument("--graph-max-tokens", type=int, default=32768, help="graphed mode only up to this many tokens")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU-time breakdown of each case")
    ap.add_argument("--repeat", type=int, default=5, help="timed calls per case up to 32K tokens (fewer above)")
    ap.add_argument("--page", type=int, default=None, help="KV page size (default 64; 16 with --device cpu)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--disable-passes", default="",
                    help="comma list of CP passes to leave out (e.g. read_kv_in_place: FP8 KV then feeds "
                         "sparse MLA an unpacked bf16 view instead of the records in place)")
    ap.add_argument("--max-logits-mib", type=int, default=None,
                    help="the indexer's score-chunk budget (KVLayout.max_logits_bytes; default the library's)")
    ap.add_argument("--backend", default=None, choices=("inductor", "aot_eager"),
                    help="cpgraph.compile backend (default inductor; aot_eager with --device cpu)")
    ap.add_argument("--compiled-activation-fraction", type=float, default=0.63,
                    help="skip a case when KV + this x the plan's (eager) activation peak exceeds free memory")
    ap.add_argument("--json", default=None, help="write the results here (rewritten after every case)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a dry run of every code path at tiny sizes (figures meaningless)")
    ap.add_argument("--deterministic", action="store_true",
                    help="also time CPConfig(deterministic=True) against the default compile (mode deterministic)")
    ap.add_argument("--replay", default="",
                    help="comma list of cpgraph ops (e.g. indexer_topk) whose first call in the compiled forward is "
                         "replayed alone on its own arguments, rested and right after a forward (op_replay.py)")
    ap.add_argument("--replay-rest", type=float, default=2.0, help="idle seconds before the rested replay")
    ap.add_argument("--no-gpu-state", action="store_true",
                    help="do not sample the GPU's clocks, power and throttle reasons (gpu_state.py) during timings")
    args = ap.parse_args(argv)
    args.replay_list = _split(args.replay)
    args.models_list = _split(args.models)
    args.variants_list = list(VARIANTS) if args.variants == "all" else _split(args.variants)
    args.cases_list = list(QUICK) if args.quick else _split(args.cases)
    args.modes_list = _split(args.modes)
    if args.deterministic and "deterministic" not in args.modes_list:
        args.modes_list.append("deterministic")
    if "deterministic" in args.modes_list and "compiled" not in args.modes_list:
        ap.error("the deterministic mode is timed against the compiled one: keep compiled in --modes")
    bad = ([m for m in args.models_list if m not in MODELS] + [v for v in args.variants_list if v not in VARIANTS]
           + [c for c in args.cases_list if c not in CASES] + [m for m in args.modes_list if m not in MODES])  # fmt: skip
    if bad or not (args.models_list and args.variants_list and args.cases_list and args.modes_list):
        ap.error(f"unknown or empty choice {bad}; models {', '.join(MODELS)}; variants {', '.join(VARIANTS)}; "
                 f"cases {', '.join(CASES)}; modes {', '.join(MODES)}")  # fmt: skip
    if not 2 <= args.layers <= 4:
        ap.error(f"--layers must be 2, 3 or 4, got {args.layers}")
    args.page = args.page or (64 if args.device == "cuda" else 16)
    args.backend = args.backend or ("inductor" if args.device == "cuda" else "aot_eager")
    # bf16 weights first: the FP8 variants quantise the same model in place afterwards.
    args.variants_list.sort(key=lambda v: (VARIANTS[v].weights != "bf16", list(VARIANTS).index(v)))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    vt.DEVICE = args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        print("production_shape: needs a CUDA GPU (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    if args.device == "cpu":
        # The dry run's tiny ops gain nothing from threads, and on a shared machine spinning OpenMP
        # threads made them 10x slower.
        torch.set_num_threads(1)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args) -> int:
    t_start = time.perf_counter()
    import triton

    from cpgraph.models.prefill import make_layout
    from cpgraph.ops.providers import bind_providers, selected
    from cpgraph.passes import CPConfig, compile as cp_compile

    bind_providers(args.device)  # the GPU providers, before anything is timed
    args.gpu_state = None
    if args.device == "cuda" and not args.no_gpu_state:
        args.gpu_state = gpu_state.GpuState.start(torch.cuda.current_device())
        vt.log("GPU state: " + ("clocks, power and throttle reasons sampled every "
                                f"{args.gpu_state.period_s * 1e3:.0f} ms" if args.gpu_state.available
                                else f"not sampled: {args.gpu_state.why}"))  # fmt: skip
    torch._dynamo.config.recompile_limit = max(64, getattr(torch._dynamo.config, "recompile_limit", 8))
    if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
        torch._dynamo.config.accumulated_recompile_limit = max(512, torch._dynamo.config.accumulated_recompile_limit)
    cases = [CASES[c] for c in args.cases_list]
    if args.device == "cpu":
        cases = [Case(c.name, c.requests, TINY_EXTEND[c.name]) for c in cases]
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (dry run, tiny sizes)"
    n_compiles = len(args.models_list) * len(args.variants_list) * len(cases)
    vt.log(f"device {dev_name}; torch {torch.__version__}, triton {triton.__version__}; models {args.models_list}, "
           f"variants {args.variants_list}, cases {[c.name for c in cases]}, modes {args.modes_list}, "
           f"{args.layers} layers, backend {args.backend}: {n_compiles} compiles planned")  # fmt: skip
    gemm = gemm_baselines()
    vt.log(f"same-run GEMMs {gemm['n']}^3 (TFLOP/s): bf16 {gemm['bf16_tflops']:.0f}, FP8 per-tensor "
           f"{_fmt(gemm['fp8_tensorwise_tflops'], '.0f')} {gemm.get('fp8_tensorwise_skipped', '')}, FP8 blockwise "
           f"{_fmt(gemm['fp8_blockwise_tflops'], '.0f')} {gemm.get('fp8_blockwise_skipped', '')}")  # fmt: skip
    meta = {"device": dev_name, "torch": torch.__version__, "triton": triton.__version__, "gemm": gemm,
            "args": {k: v for k, v in vars(args).items() if k != "gpu_state"}, "flop_formula": "see benchmarks/production_shape.py",
            "models": {}}  # fmt: skip
    results: list[dict] = []
    for model_key in args.models_list:
        args.model_key = model_key
        cfg = bench_config(model_key, args.layers, args.device == "cpu")
        real = real_config(model_key)
        if args.device == "cpu":
            sizes = {f.name for f in dataclasses.fields(real)} & set(TINY)
            real = dataclasses.replace(real, **{k: getattr(cfg, k) for k in sizes})
        t0 = time.perf_counter()
        built: dict = {}
        model = _guarded(built, "error", f"{model_key} model build",
                         lambda: build_random_model(cfg, torch.device(args.device), args.seed))
        if model is None:
            results.append({"model": model_key, "variant": "-", "case": "-", "skipped": built["error"]["error"]})
            write_json(args.json, meta, results)
            continue
        kinds = list(zip(cfg.mlp_layer_types, cfg.indexer_types))
        vt.log(f"{MODELS[model_key][0]}: {cfg.num_hidden_layers} layers {kinds}, "
               f"{weight_bytes(model) / 2**30:.1f} GiB bf16 weights drawn on {args.device} in "
               f"{time.perf_counter() - t0:.1f} s")  # fmt: skip
        real_kinds = sorted(Counter(zip(real.mlp_layer_types, real.indexer_types)).items())
        meta["models"][model_key] = {"name": MODELS[model_key][0], "bench_config": cfg.to_dict(),
                                     "real_layers": real.num_hidden_layers,
                                     "real_layer_kinds": {f"{m}/{f}": n for (m, f), n in real_kinds}}
        weights = "bf16"
        for vname in args.variants_list:
            variant = VARIANTS[vname]
            torch._dynamo.reset()
            if variant.weights == "fp8" and weights == "bf16":
                t0 = time.perf_counter()
                info = _guarded(meta["models"][model_key], "fp8", f"{model_key} FP8 conversion",
                                lambda: to_fp8_weights_(model))
                weights = "fp8" if info is not None else "failed"
                if info is not None:
                    meta["models"][model_key]["fp8"] = info
                    vt.log(f"weights quantised to FP8 in place in {time.perf_counter() - t0:.1f} s: "
                           f"{weight_bytes(model) / 2**30:.1f} GiB")  # fmt: skip
            if weights != variant.weights:
                results.append({"model": model_key, "variant": vname, "case": "-",
                                "skipped": f"no {variant.weights} weights: {meta['models'][model_key].get('fp8')}"})
                write_json(args.json, meta, results)
                continue
            model.kv_layout = make_layout(model, variant.kv, args.page)
            if args.max_logits_mib is not None:
                model.kv_layout = dataclasses.replace(model.kv_layout, max_logits_bytes=args.max_logits_mib << 20)
            disabled = tuple(_split(args.disable_passes))
            compiled = cp_compile(model, CPConfig(disabled_passes=disabled), backend=args.backend, dynamic=False)
            det = None
            if "deterministic" in args.modes_list:  # the same passes disabled, so the ratio compares like with like
                det = cp_compile(model, CPConfig(disabled_passes=disabled, deterministic=True), backend=args.backend,
                                 dynamic=False)
            vt.log(f"{model_key} variant {vname} (weights {variant.weights}, KV {variant.kv})")
            for case in cases:
                vt.log(f" case {case.name} ({case.requests} x {case.extend}) [{time.perf_counter() - t_start:.0f} s]")
                row = run_case(model, compiled, cfg, real, variant, case, args, gemm, det)
                row["providers"] = selected(args.device)
                results.append(row)
                write_json(args.json, meta, results)
            del compiled, det
        del model
        gc.collect()
        torch._dynamo.reset()
        vt.reset_peak()
    meta["elapsed_s"] = time.perf_counter() - t_start
    if args.gpu_state is not None:
        args.gpu_state.stop()
        meta["gpu_state"] = args.gpu_state.why or f"sampled every {args.gpu_state.period_s * 1e3:.0f} ms"
    write_json(args.json, meta, results)
    print_tables(results, meta)
    vt.log(f"done in {meta['elapsed_s']:.0f} s" + (f"; results in {args.json}" if args.json else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
