"""Building models: bundled tiny configs, local HF checkpoints, in-memory transformers models.

Nothing here touches the network: ``from_pretrained`` reads a local directory
(``config.json`` + ``*.safetensors`` shards, with or without
``model.safetensors.index.json``) or a bundled tiny model name.

Names map one to one with transformers 5.24 except routed experts, which
checkpoints store per expert (``mlp.experts.<j>.{gate,up,down}_proj.weight``)
and transformers/cpgraph store stacked (``mlp.experts.gate_up_proj [E, 2I,
H]``, ``mlp.experts.down_proj [E, H, I]``); both layouts are accepted.
Multi-token-prediction layers (index >= ``num_hidden_layers``) are skipped,
as transformers does, unless the model was built with ``draft=True``: then
layer ``num_hidden_layers`` loads into the draft (:mod:`.mtp`, names mapped
by :func:`.mtp.checkpoint_name`) and its absence is an error.  Any mismatch raises a single :class:`WeightLoadError`
listing every missing, unexpected and mis-shaped tensor.

Checkpoint files are untrusted input: an index may only name shards inside
the checkpoint directory, and every shard's header is read and checked
before any tensor is.  ``from_pretrained`` estimates the model's bytes
before allocating anything and refuses when they exceed the memory
available (``memory_limit`` / ``CPGRAPH_MEMORY_LIMIT`` override the
detected amount; see ``docs/models.md``).

FP8 block-quantized checkpoints (``quantization_config`` with
``quant_method: fp8``) are checked against their config before any tensor
is read and loaded dequantized or with e4m3 weights kept
(``weights="fp8"``); the rules live in :mod:`.fp8`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import Tensor

from .config import DSAConfig, bundled_config_dict, bundled_names
from . import fp8 as fp8ckpt
from .model import DecoderLayer, DSAForCausalLM
from .layers import RotaryTable
from .moe import expert_shard, local_expert_range, shard_experts
from .mtp import checkpoint_name as draft_checkpoint_name
from .mtp import draft_layer_config

# Tensors kept in fp32 whatever the requested dtype (transformers does the same).
_FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")
_EXPERT_RE = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

MEMORY_LIMIT_ENV = "CPGRAPH_MEMORY_LIMIT"

log = logging.getLogger(__name__)


class WeightLoadError(ValueError):
    """The checkpoint does not match the model; the message lists every problem."""

    def __init__(self, missing: list[str], unexpected: list[str], mis_shaped: list[str]):
        self.missing, self.unexpected, self.mis_shaped = missing, unexpected, mis_shaped
        parts = []
        for title, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", mis_shaped)):
            if items:
                parts.append(f"{len(items)} {title}:\n  " + "\n  ".join(items))
        super().__init__("checkpoint does not match the model config:\n" + "\n".join(parts))


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(_DTYPES)}")


def _keeps_fp32(name: str) -> bool:
    return name.endswith(_FP32_SUFFIXES)


def build_model(cfg: DSAConfig, dtype=torch.float32, device="cpu", *, draft: bool = False) -> DSAForCausalLM:
    """An uninitialised model in ``dtype`` (fp32-kept tensors stay fp32); ``draft``: with the MTP layer."""
    dtype = resolve_dtype(dtype)
    with torch.device(device):
        model = DSAForCausalLM(cfg, draft=draft)
    for name, p in model.named_parameters():
        if not _keeps_fp32(name):
            p.data = p.data.to(dtype)
    return model.eval()


def init_random(model: DSAForCausalLM, seed: int = 0, std: float = 0.02) -> DSAForCausalLM:
    """Deterministic random weights (same seed -> same weights on any machine).

    Matrices ~ N(0, std); norm weights ~ 1 + N(0, 0.1) so that a wrong norm
    placement shows in the logits; biases and the router correction bias small
    random.  Drawn in fp32 on the CPU in sorted-name order, then cast.
    """
    g = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    with torch.no_grad():
        for name in sorted(tensors):
            t = tensors[name]
            if name.endswith("inv_freq"):
                continue
            if re.search(r"(norm|layernorm)\.weight$", name):
                v = 1 + 0.1 * torch.randn(t.shape, generator=g)
            elif name.endswith("bias"):
                v = 0.05 * torch.randn(t.shape, generator=g)
            else:
                v = std * torch.randn(t.shape, generator=g)
            t.copy_(v.to(t.dtype))
    return model


def tiny_model(name: str, dtype=torch.float32, seed: int = 0, device="cpu", *, draft: bool = False) -> DSAForCausalLM:
    """A bundled tiny config (see :func:`bundled_names`) with seeded random weights.

    ``draft=True`` adds a random MTP draft layer; its tensors sort after the
    target's, so the target's weights are the same with or without it.
    """
    d = bundled_config_dict(name)
    cfg = DSAConfig.from_hf_dict(d)
    model = build_model(cfg, dtype, device, draft=draft)
    return init_random(model, seed=seed, std=float(d.get("initializer_range", 0.02)))


# ---------------------------------------------------------------- checking
def _expected(model: DSAForCausalLM) -> dict[str, Tensor]:
    out = dict(model.state_dict(keep_vars=True))
    for k in [k for k in out if k.endswith("inv_freq")]:
        del out[k]
    return out


def _stack_experts(named: Iterable[tuple[str, Tensor]], cfg: DSAConfig) -> Iterator[tuple[str, Tensor]]:
    """Yield tensors with per-expert weights folded into transformers' stacked layout.

    Incomplete expert sets are passed through under their own names so that
    the checker reports them (as unexpected names, plus the missing stack).
    """
    experts: dict[str, dict[tuple[int, str], Tensor]] = {}
    for name, t in named:
        m = _EXPERT_RE.match(name)
        if m is None:
            yield name, t
            continue
        experts.setdefault(m.group(1), {})[(int(m.group(3)), m.group(4))] = t
    E = cfg.n_routed_experts
    for prefix, parts in experts.items():
        complete = all((j, k) in parts for j in range(E) for k in ("gate_proj", "up_proj", "down_proj"))
        complete = complete and len(parts) == 3 * E
        shapes_ok = complete and all(
            parts[(j, "gate_proj")].shape == parts[(0, "gate_proj")].shape
            and parts[(j, "up_proj")].shape == parts[(0, "gate_proj")].shape
            and parts[(j, "down_proj")].shape == parts[(0, "down_proj")].shape
            for j in range(E)
        )
        if not shapes_ok:
            for (j, k), t in sorted(parts.items()):
                yield f"{prefix}.{j}.{k}.weight", t
            continue
        yield f"{prefix}.gate_up_proj", torch.stack(
            [torch.cat((parts[(j, "gate_proj")], parts[(j, "up_proj")]), 0) for j in range(E)]
        )
        yield f"{prefix}.down_proj", torch.stack([parts[(j, "down_proj")] for j in range(E)])


def load_state(model: DSAForCausalLM, named: Iterable[tuple[str, Tensor]]) -> DSAForCausalLM:
    """Copy checkpoint tensors into ``model`` (converting dtype) after checking names and shapes."""
    cfg = model.config
    expected = _expected(model)
    seen: dict[str, Tensor] = {}
    unexpected, mis_shaped, wrong = [], [], set()
    draft = getattr(model, "has_draft", False)
    draft_seen = False
    for name, t in _stack_experts(named, cfg):
        m = _LAYER_RE.match(name)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            mapped = draft_checkpoint_name(cfg, name) if draft else None
            if mapped is None:
                continue  # multi-token-prediction layers the model does not hold
            draft_seen = True
            if not mapped:
                continue  # the draft's copy of the shared embedding / head: the target's is used
            name = mapped
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name not in expected:
            unexpected.append(f"{name} {tuple(t.shape)}")
            continue
        want = tuple(expected[name].shape)
        if tuple(t.shape) != want:
            mis_shaped.append(f"{name}: checkpoint {tuple(t.shape)}, model expects {want}")
            wrong.add(name)
            continue
        seen[name] = t
    if draft and not draft_seen:
        raise ValueError(
            f"draft=True but the checkpoint has no MTP layer (no model.layers.{cfg.draft_layer}.* tensors)"
        )
    missing = [n for n in expected if n not in seen and n not in wrong]
    if cfg.tie_word_embeddings and "lm_head.weight" in missing and "model.embed_tokens.weight" in seen:
        missing.remove("lm_head.weight")
    if missing or unexpected or mis_shaped:
        raise WeightLoadError(
            [f"{n} {tuple(expected[n].shape)}" for n in missing], sorted(unexpected), sorted(mis_shaped)
        )
    with torch.no_grad():
        for name, t in seen.items():
            dst = expected[name]
            dst.copy_(t.to(device=dst.device, dtype=dst.dtype))
    return model


# ---------------------------------------------------------------- sources
def from_hf(hf_model, dtype=None, device="cpu", *, ep_rank: int = 0, ep_size: int = 1,
            draft: bool = False) -> DSAForCausalLM:
    """Convert an in-memory ``DeepseekV32ForCausalLM`` / ``GlmMoeDsaForCausalLM``.

    ``ep_rank`` / ``ep_size``: keep only this expert-parallel rank's routed
    experts (``docs/expert_parallel.md``).  ``draft=True`` raises: transformers
    drops the MTP layer, so an in-memory model never holds one.
    """
    config = getattr(hf_model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ValueError(f"from_hf expects a transformers model with a .config, got {type(hf_model).__name__}")
    cfg = DSAConfig.from_hf_dict(config.to_dict())
    if draft:
        raise ValueError("draft=True: transformers models drop the MTP layer; load the checkpoint with from_pretrained")
    if dtype is None:
        dtype = next(p.dtype for n, p in hf_model.named_parameters() if not _keeps_fp32(n))
    experts = _expert_range(cfg, ep_rank, ep_size)
    with expert_shard(experts):
        model = build_model(cfg, dtype, device)
    named = hf_model.state_dict().items()
    if experts is not None:
        named = _local_experts(((n, lambda rows, t=t: t if rows is None else t[rows]) for n, t in named), experts)
    return load_state(model, named)


def _read_json(path: Path):
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


def _inside(root: Path, name, where: str) -> Path:
    """``root / name``, refused unless ``name`` is a relative path that stays inside ``root``.

    Why: an index is data, and it must not make the loader read files outside
    the checkpoint the caller pointed at (``/etc/...``, ``../other``).  The
    check is lexical: symlinks that live in the checkpoint directory are the
    directory owner's choice and are followed, which is what a Hugging Face hub
    cache snapshot (files linking to ``../../blobs``) needs.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where} names a shard that is not a file name: {name!r}")
    if Path(name).is_absolute():
        raise ValueError(f"{where} names shard {name!r} by an absolute path; shards must lie inside {root}")
    parts = Path(os.path.normpath(name)).parts
    if not parts or parts[0] == "..":
        raise ValueError(f"{where} names shard {name!r}, which resolves outside the checkpoint directory {root}")
    return root / name


def _safetensors_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        data = _read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: weight_map must be a non-empty object mapping tensor names to shard files")
        files = sorted({_inside(root, v, str(index)) for v in weight_map.values()})
        absent = [str(p.name) for p in files if not p.is_file()]
        if absent:
            raise ValueError(f"{index} names shard files that do not exist: {', '.join(absent)}")
        return files
    files = sorted(_inside(root, p.name, str(root)) for p in root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{root} holds no *.safetensors files")
    return files


def _shard_error(path: Path, exc: Exception) -> ValueError:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ValueError(f"{path}: not a valid safetensors file (truncated or corrupt?): {reason}")


def _catalog(files: list[Path]) -> dict[str, "fp8ckpt.TensorInfo"]:
    """Every shard's header (names, dtypes, shapes), read before any tensor: a bad shard fails here."""
    from safetensors import safe_open

    out = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    out[key] = fp8ckpt.TensorInfo(sl.get_dtype(), tuple(sl.get_shape()))
        except Exception as exc:  # safetensors raises its own SafetensorError, or OSError
            raise _shard_error(path, exc) from None
    return out


def _read_tensors(files: list[Path], names: set[str]) -> dict[str, Tensor]:
    """Read only ``names`` (small tensors the loader needs before streaming the rest)."""
    from safetensors import safe_open

    out = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in names.intersection(f.keys()):
                    out[key] = f.get_tensor(key)
        except Exception as exc:
            raise _shard_error(path, exc) from None
    return out


# --------------------------------------------------- expert-parallel shards
# Any per-expert tensor (weights, and scales of quantised checkpoints) and the stacked expert tensors.
_PER_EXPERT_RE = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")
_STACKED_EXPERTS_RE = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")
_ST_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                   "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


def _expert_range(cfg: DSAConfig, ep_rank: int, ep_size: int) -> tuple[int, int] | None:
    """The routed experts this rank keeps, or ``None`` for all (``ep_size == 1``)."""
    if ep_size == 1 and ep_rank == 0:
        return None
    return local_expert_range(cfg.n_routed_experts, ep_rank, ep_size)


def _local_experts(entries, experts: tuple[int, int]) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` pairs with only the routed experts ``[start, stop)`` read.

    ``entries`` yields ``(name, read)`` where ``read(rows)`` returns the
    tensor (``rows=None``) or its leading-dim slice.  Per-expert tensors of
    other experts are never read; stacked ``[E, ...]`` tensors are read as
    their ``[start, stop)`` rows only; per-expert weights of local experts
    are stacked here, layer by layer, into the layout the sharded model
    holds.  So host memory is bounded by the local share plus one layer's
    stack.  An incomplete local set is passed through under its own names
    for :func:`load_state` to report.
    """
    start, stop = experts
    parts: dict[str, dict[tuple[int, str], Tensor]] = {}
    for name, read in entries:
        m = _PER_EXPERT_RE.match(name)
        if m is not None:
            if not start <= int(m.group(1)) < stop:
                continue
            w = _EXPERT_RE.match(name)
            if w is None:
                yield name, read(None)
            else:
                parts.setdefault(w.group(1), {})[(int(w.group(3)), w.group(4))] = read(None)
            continue
        yield name, read(slice(start, stop) if _STACKED_EXPERTS_RE.match(name) else None)
    kinds = ("gate_proj", "up_proj", "down_proj")
    for prefix in list(parts):
        got = parts.pop(prefix)
        complete = len(got) == 3 * (stop - start) and all((j, k) in got for j in range(start, stop) for k in kinds)
        if complete and all(got[(j, "gate_proj")].shape == got[(j, "up_proj")].shape == got[(start, "gate_proj")].shape
                            and got[(j, "down_proj")].shape == got[(start, "down_proj")].shape
                            for j in range(start, stop)):
            yield f"{prefix}.gate_up_proj", torch.stack(
                [torch.cat((got.pop((j, "gate_proj")), got.pop((j, "up_proj"))), 0) for j in range(start, stop)])
            yield f"{prefix}.down_proj", torch.stack([got.pop((j, "down_proj")) for j in range(start, stop)])
        else:
            for (j, k), t in sorted(got.items()):
                yield f"{prefix}.{j}.{k}.weight", t


def _safetensors_entries(files: list[Path]):
    """``(name, read)`` per checkpoint tensor, read lazily (``safe_open`` + ``get_slice``) by :func:`_local_experts`."""
    from safetensors import safe_open

    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    def read(rows, key=key, f=f, path=path):
                        try:
                            return f.get_tensor(key) if rows is None else f.get_slice(key)[rows]
                        except Exception as exc:
                            raise _shard_error(path, exc) from None
                    yield key, read
        except GeneratorExit:
            raise
        except Exception as exc:
            raise _shard_error(path, exc) from None


def _staged_bytes(files: list[Path], experts: tuple[int, int] | None, num_experts: int) -> int:
    """Checkpoint bytes the loader holds in host RAM: the files, or with ``experts`` the local share (headers only)."""
    if experts is None:
        return sum(p.stat().st_size for p in files)
    from safetensors import safe_open

    start, stop = experts
    total = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                m = _PER_EXPERT_RE.match(key)
                if m is not None and not start <= int(m.group(1)) < stop:
                    continue
                sl = f.get_slice(key)
                n = _ST_DTYPE_BYTES.get(sl.get_dtype(), 8) * math.prod(sl.get_shape())
                total += n * (stop - start) // num_experts if _STACKED_EXPERTS_RE.match(key) else n
    return total


# ------------------------------------------------------------- memory check
def estimate_model_bytes(cfg: DSAConfig, dtype=torch.float32) -> int:
    """Bytes ``build_model(cfg, dtype)`` allocates (parameters and buffers), without allocating them.

    Builds one decoder layer of each (MLP kind, indexer kind) on the meta
    device and multiplies by the number of such layers, so the cost does not
    grow with the layer count and the module code stays the one source of
    truth for shapes.
    """
    dtype = resolve_dtype(dtype)

    def nbytes(module, prefix: str) -> int:
        total = 0
        for name, p in module.named_parameters():
            size = 4 if _keeps_fp32(prefix + name) else dtype.itemsize
            total += p.numel() * (size if p.dtype.is_floating_point else p.element_size())
        return total + sum(b.numel() * b.element_size() for b in module.buffers())

    kinds: dict[tuple[str, str], list[int]] = {}
    for i, kind in enumerate(zip(cfg.mlp_layer_types, cfg.indexer_types)):
        kinds.setdefault(kind, []).append(i)
    try:
        with torch.device("meta"):
            total = nbytes(DSAForCausalLM(dataclasses.replace(cfg, num_hidden_layers=0, mlp_layer_types=(),
                                                              indexer_types=())), "")
            for layers in kinds.values():
                total += len(layers) * nbytes(DecoderLayer(cfg, layers[0]), f"model.layers.{layers[0]}.")
    except (RuntimeError, OverflowError) as exc:
        raise ValueError(f"the config describes tensors too large to build: {str(exc).splitlines()[0]}") from None
    return total


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n} bytes)"


def _host_available() -> int | None:
    """Available host RAM (Linux ``MemAvailable``), or ``None`` when the platform does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _memory_limit(memory_limit):
    """``None`` (detect), ``"off"``, or a byte count, from the argument or else ``CPGRAPH_MEMORY_LIMIT``."""
    source = "memory_limit"
    if memory_limit is None:
        memory_limit = os.environ.get(MEMORY_LIMIT_ENV) or None
        source = MEMORY_LIMIT_ENV
        if isinstance(memory_limit, str) and memory_limit.strip().isdigit():
            memory_limit = int(memory_limit.strip())
    if memory_limit is None or memory_limit == "off":
        return memory_limit
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, int) or memory_limit < 1:
        raise ValueError(f"{source} must be a positive number of bytes or 'off', got {memory_limit!r}")
    return memory_limit


def check_memory(cfg: DSAConfig, dtype, device, *, staged_bytes: int = 0, memory_limit=None, what: str = "model",
                 saved_bytes: int = 0) -> int:
    """Refuse (``ValueError``) before allocating when the model cannot fit; returns the estimated model bytes.

    ``staged_bytes``: checkpoint bytes held in host RAM while loading (the
    loader reads every tensor before copying any, so a failed load changes
    nothing).  On ``cuda`` the model must fit the device's free memory and the
    staged checkpoint the host's; on ``cpu`` both share host RAM.
    ``memory_limit`` (bytes) replaces the detected amounts; ``"off"`` skips
    the check.  ``saved_bytes``: what FP8 weights save against ``dtype``.
    """
    limit = _memory_limit(memory_limit)
    need = estimate_model_bytes(cfg, dtype) - saved_bytes  # saved_bytes: FP8 weights kept at 1 byte
    if limit == "off":
        return need
    dev = torch.device(device)
    if dev.type == "meta":
        return need
    checks = []  # (bytes needed, where, available)
    if dev.type == "cuda":
        if limit is None:
            free, _ = torch.cuda.mem_get_info(dev)
        checks.append((need, f"device memory on {dev}", limit if limit is not None else free))
        if staged_bytes:
            checks.append((staged_bytes, "host RAM (checkpoint staging)", limit if limit is not None else _host_available()))
    elif dev.type == "cpu":
        checks.append((need + staged_bytes, "host RAM", limit if limit is not None else _host_available()))
    else:
        if limit is None:
            log.warning("from_pretrained: no memory check for device type %r (cannot query its free memory)", dev.type)
            return need
        checks.append((need, f"memory on {dev}", limit))
    for want, where, available in checks:
        if available is None:
            log.warning("from_pretrained: cannot tell how much %s is available; skipping the memory check", where)
            continue
        if want > available:
            detail = f"{need} bytes of weights in {resolve_dtype(dtype)}"
            if staged_bytes and "host" in where:
                detail += f" + {staged_bytes} bytes of checkpoint read before copying"
            raise ValueError(
                f"{what} needs about {_gib(want)} of {where} ({detail}) but {_gib(available)} is available; "
                f"use a smaller dtype, or override with memory_limit= / {MEMORY_LIMIT_ENV}=BYTES|off"
            )
    return need


def _materialize(model: DSAForCausalLM, cfg: DSAConfig, device) -> DSAForCausalLM:
    """Allocate a meta-built model on ``device`` (uninitialised); recompute what loading does not fill.

    Every persistent tensor is then written by :func:`load_state`, which
    reports any the checkpoint lacks.  The only non-persistent buffer is the
    RoPE table, rebuilt here; a module that adds another one makes this
    raise rather than leave it uninitialised.
    """
    persistent = set(model.state_dict())
    derived = sorted(n for n, _ in model.named_buffers() if n not in persistent)
    if derived != ["model.rotary.inv_freq"]:
        raise RuntimeError(f"cannot rebuild non-persistent buffers {derived} of a meta-built model")
    model.to_empty(device=device)
    with torch.device(device):
        model.model.rotary = RotaryTable(cfg.rope, cfg.qk_rope_head_dim)
    return model


def from_pretrained(path, dtype=None, device="cpu", seed: int = 0, *, memory_limit=None, ep_rank: int = 0,
                    ep_size: int = 1, weights: str | None = None, draft: bool = False) -> DSAForCausalLM:
    """Load a local HF checkpoint directory, or build a bundled tiny model by name.

    ``dtype``: ``None`` keeps the config's ``torch_dtype`` (float32 for the
    bundled models); ``torch.bfloat16`` etc. converts.  Never downloads.
    Before allocating, the model's bytes are estimated and compared with the
    free memory of ``device`` (host RAM for ``cpu``); ``memory_limit`` (bytes,
    or ``"off"``; default: ``$CPGRAPH_MEMORY_LIMIT``, else detected) overrides.
    ``ep_rank`` / ``ep_size``: build and read only this expert-parallel
    rank's routed experts (:func:`_local_experts`); the memory check counts
    that share only.
    ``weights`` (FP8 block-quantized checkpoints, :mod:`.fp8`):
    ``"dequantize"`` (the default) gives ``dtype`` weights; ``"fp8"`` keeps
    the e4m3 weights and block scales in :class:`~.fp8.FP8Linear` modules
    (``kv_b_proj`` stays dequantized; routed experts become ``FP8Experts``).  ``"fp8"`` on a
    checkpoint without FP8 weights raises.
    ``draft=True`` also loads the MTP draft layer (``model.layers.{N}.*``,
    docs/mtp.md); a checkpoint without one raises.  Bundled models get a
    seeded random draft layer.
    """
    if weights not in (None,) + fp8ckpt.WEIGHTS_MODES:
        raise ValueError(f"weights must be one of {', '.join(fp8ckpt.WEIGHTS_MODES)}, got {weights!r}")
    root = Path(path)
    if not root.is_dir():
        if weights == "fp8" and str(path) in bundled_names():
            raise ValueError(f"weights='fp8' needs an FP8 checkpoint; bundled model {str(path)!r} has random dense weights")
        if str(path) in bundled_names():
            dt = resolve_dtype(dtype or "float32")
            cfg = DSAConfig.from_hf_dict(bundled_config_dict(str(path)))
            experts = _expert_range(cfg, ep_rank, ep_size)
            with expert_shard(experts):
                # The draft's decoder layer counted as one more layer (its norms and eh_proj are small).
                check_memory(draft_layer_config(cfg) if draft else cfg, dt, device, memory_limit=memory_limit,
                             what=f"bundled model {path!r}")
            # Drawn whole (same seed -> same weights as the unsharded model), then cut.
            model = tiny_model(str(path), dtype=dt, seed=seed, device=device, draft=draft)
            return model if experts is None else shard_experts(model, experts)
        raise ValueError(
            f"{path!r} is neither a local checkpoint directory nor a bundled model "
            f"({', '.join(bundled_names())}); cpgraph never downloads weights"
        )
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{root} has no config.json")
    cfg = DSAConfig.from_hf_dict(_read_json(cfg_path))
    if draft and cfg.num_nextn_predict_layers < 1:
        raise ValueError(f"draft=True but {cfg_path} declares no MTP layer (num_nextn_predict_layers is 0 or absent)")
    dt = resolve_dtype(dtype or cfg.torch_dtype)
    files = _safetensors_files(root)
    catalog = _catalog(files)
    plan = fp8ckpt.plan_checkpoint(cfg, catalog)
    if weights == "fp8" and not (plan and plan.scales):
        raise ValueError(f"weights='fp8' needs an FP8 checkpoint (float8_e4m3fn weights with weight_scale_inv); {root} has none")
    experts = _expert_range(cfg, ep_rank, ep_size)

    def wanted(name: str) -> bool:  # tensors this rank reads (MTP layers and other ranks' experts are skipped)
        layer = _LAYER_RE.match(name)
        if layer and int(layer.group(1)) >= cfg.num_hidden_layers:
            if not (draft and int(layer.group(1)) == cfg.draft_layer):
                return False
        m = _PER_EXPERT_RE.match(name)
        return experts is None or m is None or experts[0] <= int(m.group(1)) < experts[1]

    fp8_modules = plan.fp8_modules(cfg) if weights == "fp8" else []
    keep_fp8 = {m + ".weight" for m in fp8_modules}
    staged = _staged_bytes(files, experts, cfg.n_routed_experts)
    saved = 0
    if plan is not None:
        staged += fp8ckpt.dequantized_extra_bytes(plan, catalog, keep_fp8, dt, wanted)
        # Only the tensors this rank reads save bytes (an EP rank reads its own experts).
        saved = fp8ckpt.fp8_saved_bytes(plan, catalog, [m for m in fp8_modules if wanted(m + ".weight")], dt)
    with expert_shard(experts):
        check_memory(draft_layer_config(cfg) if draft else cfg, dt, device, staged_bytes=staged,
                     memory_limit=memory_limit, what=f"checkpoint {root}",
                     saved_bytes=saved)
        # FP8 modules replace dense ones: build on meta first so the dense weights are never allocated.
        model = build_model(cfg, dt, "meta" if fp8_modules else device, draft=draft)
    if fp8_modules:
        keep_fp8 = fp8ckpt.swap_fp8_linears(model, fp8_modules, plan.quant)
        model = _materialize(model, cfg, device)
    entries = _safetensors_entries(files)
    if plan is not None:
        scales = _read_tensors(files, set(fp8ckpt.scale_names_to_read(plan, keep_fp8, wanted)))
        entries = fp8ckpt.dequantized_entries(entries, plan, scales, dt, keep_fp8)
    if experts is None:
        return load_state(model, ((name, read(None)) for name, read in entries))
    return load_state(model, _local_experts(entries, experts))
