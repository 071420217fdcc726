"""FP8 block-quantized checkpoints: what is quantized, checks, dequantisation, and ``FP8Linear``.

The DeepSeek-V3.2 / GLM-5 FP8 releases store a quantized linear weight
``X.weight`` ``[out, in]`` as e4m3 next to ``X.weight_scale_inv``, fp32
``[ceil(out / bo), ceil(in / bi)]`` with ``(bo, bi)`` =
``quantization_config.weight_block_size``; the weight's value is
``e4m3 * scale`` of its block.  Which weights are quantized is read from
the checkpoint itself (a ``weight_scale_inv`` sibling); a module named in
``modules_to_not_convert`` must not be.

Two ways to load (``from_pretrained(..., weights=...)``):

* ``"dequantize"``: every quantized weight becomes ``e4m3 * scale`` in fp32,
  then the model dtype -- the arithmetic transformers uses, so the result is
  the same model; the CPU path and the oracle;
* ``"fp8"``: projections that the model calls as layers become
  :class:`FP8Linear` modules that keep the e4m3 weight and its block scales
  and run ``cpgraph::fp8_block_linear``; the routed experts become
  :class:`~cpgraph.models.moe.FP8Experts` (e4m3 ``[E, 2I, H]`` / ``[E, H,
  I]`` stacks plus stacked block scales, computed by ``cpgraph::moe_experts``
  with the scales passed).  ``self_attn.kv_b_proj`` stays dequantized (the
  absorbed attention reads its matrix as ``W_UK`` / ``W_UV`` einsum
  operands, it is never called as a layer), and so do the routed experts of
  a layer whose ``moe_intermediate_size`` is not a multiple of the block's
  rows or whose experts are not all quantized (logged once; the stacked gate
  and up halves must not share a scale row); the router and the indexer's
  ``weights_proj`` are fp32 by the model's definition.

Every malformed input raises :class:`FP8CheckpointError`, one line naming
the tensor, before any tensor data is read.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch
from torch import Tensor, nn

import cpgraph.ops.fp8_linear  # noqa: F401  (registers cpgraph::fp8_block_linear)
from cpgraph.ops.fp8_linear import ceil_div, dequantize_weight

from .config import DSAConfig, FP8Quantization
from .moe import Experts, FP8Experts

_ops = torch.ops.cpgraph
log = logging.getLogger("cpgraph.models")

SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> "X.weight_scale_inv"
FP8_DTYPE = "F8_E4M3"  # safetensors' name of float8_e4m3fn
WEIGHTS_MODES = ("dequantize", "fp8")

# Projections kept dense in "fp8" mode because code reads their matrix directly (see the module docstring).
DENSE_ONLY_SUFFIXES = ("self_attn.kv_b_proj",)
# Modules whose weight is fp32 by the model's definition (the router, the indexer's head weights).
_FP32_MODULES = ("mlp.gate", "indexer.weights_proj")
_PER_EXPERT_RE = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.")
# A routed expert's projection module: (experts module, expert index, projection).
_EXPERT_MODULE_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")
_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


_LOGGED: set[str] = set()


class FP8CheckpointError(ValueError):
    """A block-quantized checkpoint that does not follow its own ``quantization_config``."""


@dataclass(frozen=True)
class TensorInfo:
    """One checkpoint tensor as its safetensors header describes it (no data read)."""

    dtype: str  # safetensors dtype name: "F8_E4M3", "F32", "BF16", ...
    shape: tuple[int, ...]


@dataclass
class QuantPlan:
    """The checkpoint's quantized weights: ``weight name -> scale name``, and the block recipe."""

    quant: FP8Quantization
    scales: dict[str, str] = field(default_factory=dict)

    def fp8_modules(self, cfg: DSAConfig) -> list[str]:
        """Modules kept in e4m3 in ``"fp8"`` mode (names without ``.weight``).

        :class:`FP8Linear` layers, and the per-expert projections
        (``...mlp.experts.<j>.gate_proj``) of every layer whose routed
        experts can stay FP8 (:meth:`fp8_expert_layers`).
        """
        expert_layers = self.fp8_expert_layers(cfg)
        out = []
        for weight in sorted(self.scales):
            module = weight[: -len(".weight")]
            layer = _LAYER_RE.match(weight)
            if layer and int(layer.group(1)) >= cfg.num_hidden_layers:
                continue  # multi-token-prediction layers are not loaded
            expert = _EXPERT_MODULE_RE.match(module)
            if expert is not None:
                if expert.group(1) in expert_layers:
                    out.append(module)
                continue
            if _PER_EXPERT_RE.match(weight) or module.endswith(DENSE_ONLY_SUFFIXES + _FP32_MODULES):
                continue
            out.append(module)
        return out

    def fp8_expert_layers(self, cfg: DSAConfig) -> set[str]:
        """``...mlp.experts`` prefixes whose routed experts stay e4m3: all ``3 E`` projections quantized, and
        ``moe_intermediate_size`` a multiple of the block's rows (else they are dequantized, logged once)."""
        counts: dict[str, int] = {}
        for weight in self.scales:
            m = _EXPERT_MODULE_RE.match(weight[: -len(".weight")])
            if m is not None:
                counts[m.group(1)] = counts.get(m.group(1), 0) + 1
        full = {p for p, n in counts.items() if n == 3 * cfg.n_routed_experts}
        why = None
        if counts and cfg.moe_intermediate_size % self.quant.block[0]:
            why = (f"moe_intermediate_size {cfg.moe_intermediate_size} is not a multiple of the "
                   f"{self.quant.block[0]}-row weight block")
            full = set()
        elif len(full) != len(counts):
            why = f"{len(counts) - len(full)} layer(s) do not quantize all {3 * cfg.n_routed_experts} expert projections"
        if why and why not in _LOGGED:
            _LOGGED.add(why)
            log.warning("weights='fp8': routed experts of %d layer(s) are dequantized: %s", len(counts) - len(full), why)
        return full


def _expected_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return ceil_div(shape[0], block[0]), ceil_div(shape[1], block[1])


def _other_block(shape, scale_shape) -> str:
    """A hint naming a power-of-two block size the scale grid does fit, if any."""
    for bo in (2**i for i in range(4, 12)):
        for bi in (2**i for i in range(4, 12)):
            if _expected_scale_shape(shape, (bo, bi)) == tuple(scale_shape):
                return f" (it fits blocks of {bo}x{bi}: the checkpoint was quantized with another block size than config.json states)"
    return ""


def plan_checkpoint(cfg: DSAConfig, catalog: dict[str, TensorInfo]) -> QuantPlan | None:
    """Check the checkpoint's quantized tensors against ``cfg.quantization``; ``None`` for an unquantized one.

    Raises :class:`FP8CheckpointError` (one line, naming the tensor) for: an
    e4m3 weight without ``quantization_config``; a quantized weight without
    its scale; a scale of the wrong shape (which is how a block size other
    than the config's shows) or dtype; a scale without an e4m3 weight; a
    quantized weight that is not 2-D; e5m2 weights; a quantized module that
    ``modules_to_not_convert`` lists.
    """
    q = cfg.quantization
    for name in sorted(catalog):
        info = catalog[name]
        if info.dtype == FP8_DTYPE and q is None:
            raise FP8CheckpointError(
                f"{name}: float8_e4m3fn weight but config.json has no quantization_config "
                "(an FP8 checkpoint must state its quant_method and weight_block_size)"
            )
        if info.dtype.startswith("F8_") and info.dtype != FP8_DTYPE:
            raise FP8CheckpointError(f"{name}: {info.dtype} weights are not supported (only e4m3 with block scales)")
    if q is None:
        return None
    plan = QuantPlan(q)
    for name in sorted(catalog):
        info = catalog[name]
        if name.endswith(SCALE_SUFFIX):
            weight = name[: -len(SCALE_SUFFIX)]
            if weight not in catalog or catalog[weight].dtype != FP8_DTYPE:
                raise FP8CheckpointError(f"{name}: block scale without a float8_e4m3fn weight {weight}")
            continue
        if info.dtype != FP8_DTYPE:
            continue
        scale = name + SCALE_SUFFIX
        if not name.endswith(".weight") or len(info.shape) != 2:
            raise FP8CheckpointError(
                f"{name}: quantized tensor of shape {info.shape}; only 2-D [out, in] '.weight' matrices "
                "(experts stored one per file entry) are supported"
            )
        module = name[: -len(".weight")]
        if q.skips(module):
            raise FP8CheckpointError(
                f"{name}: module {module} is listed in quantization_config.modules_to_not_convert but stored as float8_e4m3fn"
            )
        if scale not in catalog:
            raise FP8CheckpointError(f"{name}: quantized weight has no block scale {scale} in the checkpoint")
        s = catalog[scale]
        if s.dtype != "F32":
            raise FP8CheckpointError(f"{scale}: block scales must be float32 (F32), got {s.dtype}")
        want = _expected_scale_shape(info.shape, q.block)
        if tuple(s.shape) != want:
            raise FP8CheckpointError(
                f"{scale}: shape {tuple(s.shape)} does not match weight {info.shape} in blocks of "
                f"{q.block[0]}x{q.block[1]} (quantization_config.weight_block_size), expected {want}"
                + _other_block(info.shape, s.shape)
            )
        plan.scales[name] = scale
    return plan


# ------------------------------------------------------------ loading
def dequantized_entries(entries: Iterable[tuple[str, Callable]], plan: QuantPlan, scales: dict[str, Tensor],
                        dtype: torch.dtype, keep_fp8: set[str]) -> Iterator[tuple[str, Callable]]:
    """Turn ``(name, read)`` checkpoint entries into what the model holds.

    A quantized weight in ``keep_fp8`` (an :class:`FP8Linear`'s) passes
    through with its scale; any other quantized weight is read as
    ``e4m3 * scale`` (fp32) cast to ``dtype``, and its scale is dropped.
    ``read(rows)`` reads a tensor (``rows=None``) or a leading-dim slice.
    """
    bo, bi = plan.quant.block
    expert_scales = _ExpertScaleStacker(keep_fp8)
    for name, read in entries:
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in plan.scales:
            if name[: -len(SCALE_SUFFIX)] in keep_fp8:
                if expert_scales.wants(name):
                    yield from expert_scales.add(name, read(None))
                else:
                    yield name, read
            continue
        if name in plan.scales and name not in keep_fp8:
            # Looked up when read: entries the caller skips (other ranks' experts) have no scale loaded.
            def dequantized(rows, read=read, scale=plan.scales[name]):
                return dequantize_weight(read(rows), scales[scale], bo, bi).to(dtype)

            yield name, dequantized
            continue
        yield name, read


class _ExpertScaleStacker:
    """Stacks kept experts' per-expert block scales into :class:`FP8Experts`' layout, layer by layer.

    The e4m3 weights are stacked by the loader (as dense experts are); their
    scales are stacked here: expert ``j``'s gate and up scale rows
    concatenated (``gate_up_proj_scale_inv``), its down scales
    (``down_proj_scale_inv``), over the kept experts in index order.  Only
    the experts in ``keep_fp8`` count, which under expert parallelism are the
    rank's own (:func:`swap_fp8_linears` keeps only those), so the stacks
    match the shard.  Scales are small (about 2.7 MB per V3.2 layer), so they
    are read as they come and a layer's stacks are yielded once complete.
    """

    def __init__(self, keep_fp8: set[str]):
        self.pending: dict[str, set[tuple[int, str]]] = {}
        for weight in keep_fp8:
            m = _EXPERT_MODULE_RE.match(weight[: -len(".weight")])
            if m is not None:
                self.pending.setdefault(m.group(1), set()).add((int(m.group(2)), m.group(3)))
        self.got: dict[str, dict[tuple[int, str], Tensor]] = {}

    def wants(self, scale_name: str) -> bool:
        return _EXPERT_MODULE_RE.match(scale_name[: -len(".weight" + SCALE_SUFFIX)]) is not None

    def add(self, scale_name: str, t: Tensor) -> Iterator[tuple[str, Callable]]:
        m = _EXPERT_MODULE_RE.match(scale_name[: -len(".weight" + SCALE_SUFFIX)])
        prefix, key = m.group(1), (int(m.group(2)), m.group(3))
        got = self.got.setdefault(prefix, {})
        got[key] = t
        if len(got) < len(self.pending.get(prefix, ())):
            return
        del self.got[prefix]
        experts = sorted({j for j, _ in got})
        gate_up = torch.stack([torch.cat((got[(j, "gate_proj")], got[(j, "up_proj")]), 0) for j in experts])
        down = torch.stack([got[(j, "down_proj")] for j in experts])
        for name, stack in ((f"{prefix}.gate_up_proj{SCALE_SUFFIX}", gate_up), (f"{prefix}.down_proj{SCALE_SUFFIX}", down)):
            yield name, (lambda rows, t=stack: t if rows is None else t[rows])


def scale_names_to_read(plan: QuantPlan, keep_fp8: set[str], wanted: Callable[[str], bool]) -> list[str]:
    """Scales the dequantisation needs up front (weights may come before their scale in the files)."""
    return [s for w, s in plan.scales.items() if w not in keep_fp8 and wanted(w)]


def fp8_saved_bytes(plan: QuantPlan, catalog: dict[str, TensorInfo], modules: list[str], dtype: torch.dtype) -> int:
    """Bytes ``"fp8"`` mode saves against a ``dtype`` model: weights at 1 byte, plus their fp32 scales."""
    saved = 0
    for module in modules:
        w = catalog[module + ".weight"]
        s = catalog[module + ".weight" + SCALE_SUFFIX]
        saved += math.prod(w.shape) * (dtype.itemsize - 1) - 4 * math.prod(s.shape)
    return saved


def dequantized_extra_bytes(plan: QuantPlan, catalog: dict[str, TensorInfo], keep_fp8: set[str],
                            dtype: torch.dtype, wanted: Callable[[str], bool]) -> int:
    """Host bytes dequantisation adds to the staged checkpoint (e4m3 -> ``dtype``)."""
    return sum(math.prod(catalog[w].shape) * (dtype.itemsize - 1)
               for w in plan.scales if w not in keep_fp8 and wanted(w))


# ------------------------------------------------------------- FP8Linear
class FP8Linear(nn.Module):
    """A linear layer with block-quantized e4m3 weights, computed by ``cpgraph::fp8_block_linear``.

    ``weight`` float8_e4m3fn ``[out, in]`` and ``weight_scale_inv`` fp32
    ``[ceil(out / bo), ceil(in / bi)]`` under the checkpoint's names, so a
    state dict maps one to one; activations are quantised per token per
    ``bi`` values on the fly (power-of-two scales for ``scale_fmt: ue8m0``).
    """

    def __init__(self, in_features: int, out_features: int, quant: FP8Quantization, bias: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block = tuple(quant.block)
        self.act_scale_pow2 = quant.act_scale_pow2
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        grid = _expected_scale_shape((out_features, in_features), self.block)
        self.weight_scale_inv = nn.Parameter(torch.ones(grid, dtype=torch.float32, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        y = _ops.fp8_block_linear(x.reshape(-1, self.in_features), self.weight, self.weight_scale_inv,
                                  self.block[0], self.block[1], self.act_scale_pow2)
        y = y.view(*lead, self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        pow2 = ", ue8m0 activation scales" if self.act_scale_pow2 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block={self.block[0]}x{self.block[1]}, bias={self.bias is not None}{pow2}")


def swap_fp8_linears(model: nn.Module, modules: list[str], quant: FP8Quantization) -> set[str]:
    """Replace the named ``nn.Linear`` modules of ``model`` by :class:`FP8Linear`; returns their weight names.

    Per-expert names (``...mlp.experts.<j>.gate_proj``) turn their layer's
    :class:`Experts` into :class:`FP8Experts` instead.

    A name the model does not have is left for the loader to report (as an
    unexpected checkpoint tensor); a name that is not an ``nn.Linear``
    (a model change this module does not know about) raises.
    """
    kept = set()
    expert_modules: dict[str, list[tuple[int, str]]] = {}
    for name in modules:
        expert = _EXPERT_MODULE_RE.match(name)
        if expert is not None:
            expert_modules.setdefault(expert.group(1), []).append((int(expert.group(2)), name))
            continue
        parent_name, _, leaf = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name) if parent_name else model
        except AttributeError:
            continue
        old = getattr(parent, leaf, None)
        if old is None:
            continue
        if type(old) is not nn.Linear:
            raise FP8CheckpointError(
                f"{name}.weight: stored quantized, but the model's {name} is a {type(old).__name__}, not a linear layer"
            )
        new = FP8Linear(old.in_features, old.out_features, quant, bias=old.bias is not None,
                        device=old.weight.device, dtype=old.weight.dtype)
        setattr(parent, leaf, new)
        kept.add(name + ".weight")
    for prefix, names in expert_modules.items():
        kept |= _swap_experts(model, prefix, names, quant)
    return kept


def _swap_experts(model: nn.Module, prefix: str, names: list[tuple[int, str]], quant: FP8Quantization) -> set[str]:
    """Replace the :class:`Experts` at ``prefix`` by :class:`FP8Experts`; the weight names of its own experts.

    Under expert parallelism the module holds experts ``[start, stop)`` only:
    the other ranks' projections are not kept (the loader never reads them).
    """
    parent_name, _, leaf = prefix.rpartition(".")
    try:
        parent = model.get_submodule(parent_name)
    except AttributeError:
        return set()
    old = getattr(parent, leaf, None)
    if old is None:
        return set()
    if not isinstance(old, Experts):
        raise FP8CheckpointError(f"{names[0][1]}.weight: stored quantized, but the model's {prefix} is a "
                                 f"{type(old).__name__}, not routed experts")
    if not isinstance(old, FP8Experts):
        setattr(parent, leaf, FP8Experts(old, quant.block, quant.act_scale_pow2))
    start, stop = old.expert_range
    return {name + ".weight" for j, name in names if start <= j < stop}


__all__ = [
    "FP8CheckpointError",
    "FP8Linear",
    "QuantPlan",
    "TensorInfo",
    "WEIGHTS_MODES",
    "dequantized_entries",
    "plan_checkpoint",
    "swap_fp8_linears",
]
