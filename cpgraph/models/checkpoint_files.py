"""Reading safetensors checkpoint directories: shard files, headers, tensors, staged bytes.

Checkpoint files are untrusted input: an index may only name shards inside
the checkpoint directory, and every shard's header is read and checked
before any tensor is.  Keeping every file access here keeps those checks in
one place; :mod:`.loading` decides what to read, this module reads it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from torch import Tensor

from . import fp8 as fp8ckpt
from .local_experts import _PER_EXPERT_RE, _STACKED_EXPERTS_RE

# Bytes per element of each safetensors header dtype (for the staged-bytes estimate).
_ST_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                   "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


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


def _safetensors_entries(files: list[Path]):
    """``(name, read)`` per checkpoint tensor, read lazily (``safe_open`` + ``get_slice``) by :func:`.local_experts._local_experts`."""
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
