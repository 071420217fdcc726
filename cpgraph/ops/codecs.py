"""Record codecs: the byte layouts of the KV cache (docs/ops/codecs.md).

Two quantised layouts exist and both are *bit-exact contracts*, because the
bytes written here are read by production kernels (FlashMLA, DeepGEMM), sent
to decode instances and backed up to host memory:

* MLA FP8 record, 656 bytes per token: 512 e4m3 latent bytes, 4 fp32 scales
  (one per 128-value tile) at bytes 512-527, 64 bf16 RoPE values at bytes
  528-655 (RoPE is not quantised: it carries position and is small).
* index-K: e4m3 keys with one fp32 power-of-two ("ue8m0") scale per token
  per 128-value block.  A page stores ``page_size * D`` key bytes
  token-major, then ``page_size * nb`` scales token-major
  (``nb = ceil(D / 128)``): 8448 bytes for a 64-token page at D = 128.

Scale rule (both layouts): ``scale = 2 ** ceil(log2(max(amax, 1e-4) / 448))``
with ``amax`` the block's largest *finite* magnitude.  A power of two makes
``x / scale`` exact, so the only rounding is the e4m3 cast (round to nearest
even); ``448`` is the largest finite e4m3 value, so no finite value saturates.
Dequantisation is ``e4m3 * scale`` in fp32.

Non-finite rule (both layouts, every provider, byte for byte): infinities
and NaNs are ignored when the block's ``amax`` is taken, so one bad value
does not flush the rest of its block to zero; ``+inf`` / ``-inf`` are
stored as the largest e4m3 magnitude, ``0x7E`` / ``0xFE`` (``+-448 *
scale``: saturation); every NaN, whatever its sign or payload, is stored as
``0x7F`` (the positive e4m3 NaN code), so a NaN stays visible after
decoding.  RoPE values of the MLA record are bf16: bf16 input is copied bit
for bit; other input is rounded to nearest even with every NaN stored as
``0x7FC0``.  Why a rule at all: the torch casts and the kernels' integer
conversions disagree on NaN signs/payloads and on what a ``NaN``/``inf``
amax does to the scale, and these bytes are a contract.

All byte views are little-endian (``Tensor.view(torch.uint8)`` on the
platforms torch supports).  The dense MLA record is just ``[latent | k_pe]``
in the model dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_same_device, check_tensor
from .providers import select

FLOATS = (torch.float32, torch.bfloat16, torch.float16)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_NAN_CODE = 0x7F  # every NaN is stored as this byte (non-finite rule)
BF16_NAN_BITS = 0x7FC0  # every NaN RoPE value from a non-bf16 input is stored as this bf16
SCALE_BLOCK = 128
SCALE_EPS = 1e-4

MLA_FP8_LATENT = 512
MLA_FP8_ROPE = 64
MLA_FP8_SCALE_OFFSET = MLA_FP8_LATENT  # bytes 512-527: 4 fp32 scales
MLA_FP8_ROPE_OFFSET = MLA_FP8_LATENT + 4 * (MLA_FP8_LATENT // SCALE_BLOCK)  # 528
MLA_FP8_RECORD_BYTES = MLA_FP8_ROPE_OFFSET + 2 * MLA_FP8_ROPE  # 656


# ---------------------------------------------------------------- helpers
def num_scale_blocks(head_dim: int) -> int:
    """Scale blocks per token: ``ceil(head_dim / 128)`` (a short last block is allowed)."""
    return (head_dim + SCALE_BLOCK - 1) // SCALE_BLOCK


def index_k_token_bytes(head_dim: int) -> int:
    """Bytes one token occupies in an fp8 index-K page (132 at D = 128)."""
    return head_dim + 4 * num_scale_blocks(head_dim)


def index_k_page_bytes(page_size: int, head_dim: int) -> int:
    """Row width of an fp8 index-K page tensor (8448 for 64 tokens at D = 128)."""
    return page_size * index_k_token_bytes(head_dim)


def check_page_size(op: str, page_size) -> None:
    """Pages are addressed with ``//`` and ``%``; production requires powers of two.

    A symbolic ``page_size`` (an int argument the compiler made dynamic) is
    accepted unchecked: checking it would add a guard for nothing.
    """
    if isinstance(page_size, torch.SymInt):
        return
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"cpgraph.{op}: argument 'page_size' must be a positive power of two, got {page_size!r}")


def pow2_scale(amax: Tensor) -> Tensor:
    """``2 ** ceil(log2(max(amax, 1e-4) / 448))`` in fp32, computed exactly.

    ``frexp`` gives ``r = m * 2**e`` with ``m`` in ``[0.5, 1)``; the ceiling
    of ``log2 r`` is ``e - 1`` when ``m == 0.5`` (r is a power of two) and
    ``e`` otherwise.  The scale is then assembled from its exponent bits, so
    no transcendental function (whose last-bit behaviour differs between
    devices) is involved.  ``amax / 448`` in fp32 never rounds down onto a
    power of two from above (448 = 1.75 * 2**8), so the fp32 division is safe.
    """
    ratio = amax.to(torch.float32).clamp_min(SCALE_EPS) / FP8_MAX
    mant, exp = torch.frexp(ratio)
    exp = exp.to(torch.int32) - (mant == 0.5).to(torch.int32)
    return ((exp + 127) << 23).view(torch.float32)


def quantize_blocks(x: Tensor) -> tuple[Tensor, Tensor]:
    """Quantise ``x [N, D]`` per token per 128-block: ``(uint8 [N, D], f32 [N, nb])``.

    A short last block (D not a multiple of 128, e.g. D = 32) is padded with
    zeros for the amax only; padding never reaches the output.  Non-finite
    values follow the module's non-finite rule (amax over finite values,
    ``+-inf`` -> ``+-448``, NaN -> ``0x7F``).
    """
    n, d = x.shape
    nb = num_scale_blocks(d)
    xf = x.to(torch.float32)
    if nb * SCALE_BLOCK != d:
        xf_blocks = torch.nn.functional.pad(xf, (0, nb * SCALE_BLOCK - d))
    else:
        xf_blocks = xf
    xf_blocks = xf_blocks.view(n, nb, SCALE_BLOCK)
    finite = torch.isfinite(xf_blocks)
    zero = torch.zeros((), dtype=torch.float32, device=xf_blocks.device)
    amax = torch.where(finite, xf_blocks.abs(), zero).amax(dim=-1)
    scales = pow2_scale(amax)  # [N, nb]
    q = (xf_blocks / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)  # +-inf -> +-448
    q = torch.where(torch.isnan(xf_blocks), torch.full((), FP8_NAN_CODE, dtype=torch.uint8, device=q.device), q)
    q = q.view(n, nb * SCALE_BLOCK)[:, :d].contiguous()
    return q, scales


def dequantize_blocks(key_bytes: Tensor, scales: Tensor) -> Tensor:
    """Inverse of :func:`quantize_blocks`: ``e4m3 * scale`` in fp32, ``[N, D]``."""
    n, d = key_bytes.shape
    nb = scales.shape[1]
    vals = key_bytes.contiguous().view(FP8).to(torch.float32)
    per_value = scales.to(torch.float32).unsqueeze(-1).expand(n, nb, SCALE_BLOCK).reshape(n, nb * SCALE_BLOCK)
    return vals * per_value[:, :d]


# ------------------------------------------------------------ mla_fp8_pack
def _check_mla_fp8_pack(latent: Tensor, k_pe: Tensor) -> None:
    check_tensor("mla_fp8_pack", "latent", latent, dtype=FLOATS, shape=(None, MLA_FP8_LATENT))
    check_tensor("mla_fp8_pack", "k_pe", k_pe, dtype=FLOATS, shape=(latent.shape[0], MLA_FP8_ROPE))
    check_same_device("mla_fp8_pack", latent=latent, k_pe=k_pe)


def rope_bf16_bytes(k_pe: Tensor) -> Tensor:
    """RoPE values as bf16 bytes ``uint8 [N, 2 R]``: bf16 copied as is, else RNE with NaN -> ``0x7FC0``."""
    if k_pe.dtype == torch.bfloat16:
        return k_pe.contiguous().view(torch.uint8)
    bits = k_pe.to(torch.bfloat16).view(torch.int16)
    nan = torch.full((), BF16_NAN_BITS, dtype=torch.int16, device=bits.device)
    return torch.where(torch.isnan(k_pe), nan, bits).contiguous().view(torch.uint8)


def mla_fp8_pack_reference(latent: Tensor, k_pe: Tensor) -> Tensor:
    q, scales = quantize_blocks(latent)
    return torch.cat([q, scales.view(torch.uint8), rope_bf16_bytes(k_pe)], dim=1)


@torch.library.custom_op("cpgraph::mla_fp8_pack", mutates_args=())
def mla_fp8_pack(latent: Tensor, k_pe: Tensor) -> Tensor:
    """Pack MLA rows into 656-byte FP8 records (``uint8 [N, 656]``).

    ``latent``: ``[N, 512]``, ``k_pe``: ``[N, 64]`` (fp32/bf16/fp16, may
    differ).  Bytes 0-511: e4m3 latent; 512-527: 4 fp32 power-of-two tile
    scales; 528-655: ``k_pe`` rounded to bf16.  Only this geometry exists in
    production (FlashMLA's FP8 KV format); other MLA sizes use the dense record.

    Non-finite input (module docstring): a tile's scale comes from its
    finite values only; ``+-inf`` latent values are stored as ``0x7E`` /
    ``0xFE`` (``+-448 * scale``), every NaN as ``0x7F``; a NaN ``k_pe`` value
    from fp32/fp16 input is stored as bf16 ``0x7FC0`` (bf16 input is copied
    bit for bit).  Every provider writes the same bytes.
    """
    _check_mla_fp8_pack(latent, k_pe)
    return select("mla_fp8_pack", latent.device.type, mla_fp8_pack_reference)(latent, k_pe)


@mla_fp8_pack.register_fake
def _mla_fp8_pack_fake(latent, k_pe):
    _check_mla_fp8_pack(latent, k_pe)
    return latent.new_empty((latent.shape[0], MLA_FP8_RECORD_BYTES), dtype=torch.uint8)


# ---------------------------------------------------------- mla_fp8_unpack
def _check_mla_fp8_unpack(records: Tensor, dtype) -> None:
    check_tensor("mla_fp8_unpack", "records", records, dtype=torch.uint8, shape=(None, MLA_FP8_RECORD_BYTES))
    if dtype not in FLOATS:
        raise ValueError(f"cpgraph.mla_fp8_unpack: argument 'dtype' must be float32, bfloat16 or float16, got {dtype}")


def mla_fp8_unpack_reference(records: Tensor, dtype: torch.dtype) -> Tensor:
    records = records.contiguous()
    scales = records[:, MLA_FP8_SCALE_OFFSET:MLA_FP8_ROPE_OFFSET].contiguous().view(torch.float32)
    latent = dequantize_blocks(records[:, :MLA_FP8_LATENT], scales)
    rope = records[:, MLA_FP8_ROPE_OFFSET:].contiguous().view(torch.bfloat16)
    return torch.cat([latent.to(dtype), rope.to(dtype)], dim=1)


@torch.library.custom_op("cpgraph::mla_fp8_unpack", mutates_args=())
def mla_fp8_unpack(records: Tensor, dtype: torch.dtype) -> Tensor:
    """Decode 656-byte FP8 records into dense ``[latent | k_pe]`` rows ``dtype [N, 576]``.

    The latent is ``e4m3 * scale`` computed in fp32 then cast to ``dtype``;
    ``k_pe`` is the stored bf16 converted to ``dtype``.  This is the dense
    key/value row the sparse attention reads (its first 512 columns are V).
    """
    _check_mla_fp8_unpack(records, dtype)
    return select("mla_fp8_unpack", records.device.type, mla_fp8_unpack_reference)(records, dtype)


@mla_fp8_unpack.register_fake
def _mla_fp8_unpack_fake(records, dtype):
    _check_mla_fp8_unpack(records, dtype)
    return records.new_empty((records.shape[0], MLA_FP8_LATENT + MLA_FP8_ROPE), dtype=dtype)


# --------------------------------------------------------- mla_dense_pack
def _check_mla_dense_pack(latent: Tensor, k_pe: Tensor) -> None:
    check_tensor("mla_dense_pack", "latent", latent, dtype=FLOATS, ndim=2)
    check_tensor("mla_dense_pack", "k_pe", k_pe, dtype=FLOATS, ndim=2, shape=(latent.shape[0], None))
    check_same_device("mla_dense_pack", latent=latent, k_pe=k_pe)


def mla_dense_pack_reference(latent: Tensor, k_pe: Tensor) -> Tensor:
    return torch.cat([latent, k_pe.to(latent.dtype)], dim=1)


@torch.library.custom_op("cpgraph::mla_dense_pack", mutates_args=())
def mla_dense_pack(latent: Tensor, k_pe: Tensor) -> Tensor:
    """Dense MLA record ``[latent | k_pe]`` (``latent.dtype [N, L + R]``, any L and R).

    A record has one dtype, the latent's; ``k_pe`` is converted to it (in
    production both are bf16).  The op exists so that cache writes show up
    by name in the graph, next to ``mla_fp8_pack``, and a pass can swap one
    record kind for the other.
    """
    _check_mla_dense_pack(latent, k_pe)
    return select("mla_dense_pack", latent.device.type, mla_dense_pack_reference)(latent, k_pe)


@mla_dense_pack.register_fake
def _mla_dense_pack_fake(latent, k_pe):
    _check_mla_dense_pack(latent, k_pe)
    return latent.new_empty((latent.shape[0], latent.shape[1] + k_pe.shape[1]))


# ------------------------------------------------- index_k_quant / dequant
def _check_index_k_quant(keys: Tensor) -> None:
    check_tensor("index_k_quant", "keys", keys, dtype=FLOATS, ndim=2)


def index_k_quant_reference(keys: Tensor) -> tuple[Tensor, Tensor]:
    return quantize_blocks(keys)


@torch.library.custom_op("cpgraph::index_k_quant", mutates_args=())
def index_k_quant(keys: Tensor) -> tuple[Tensor, Tensor]:
    """Quantise index keys ``[N, D]`` to ``(e4m3 bytes uint8 [N, D], scales f32 [N, nb])``.

    One power-of-two scale per token per 128-value block (``nb = ceil(D/128)``),
    the format DeepGEMM's ``fp8_mqa_logits`` consumes (with ``nb == 1``).
    """
    _check_index_k_quant(keys)
    return select("index_k_quant", keys.device.type, index_k_quant_reference)(keys)


@index_k_quant.register_fake
def _index_k_quant_fake(keys):
    _check_index_k_quant(keys)
    n, d = keys.shape
    return (
        keys.new_empty((n, d), dtype=torch.uint8),
        keys.new_empty((n, (d + SCALE_BLOCK - 1) // SCALE_BLOCK), dtype=torch.float32),
    )


def _check_index_k_dequant(key_bytes: Tensor, scales: Tensor) -> None:
    check_tensor("index_k_dequant", "key_bytes", key_bytes, dtype=torch.uint8, ndim=2)
    d = key_bytes.shape[1]
    nb = (d + SCALE_BLOCK - 1) // SCALE_BLOCK
    check_tensor("index_k_dequant", "scales", scales, dtype=torch.float32, shape=(key_bytes.shape[0], nb))
    check_same_device("index_k_dequant", key_bytes=key_bytes, scales=scales)


def index_k_dequant_reference(key_bytes: Tensor, scales: Tensor) -> Tensor:
    return dequantize_blocks(key_bytes, scales)


@torch.library.custom_op("cpgraph::index_k_dequant", mutates_args=())
def index_k_dequant(key_bytes: Tensor, scales: Tensor) -> Tensor:
    """Decode index keys: ``f32 [N, D] = e4m3(key_bytes) * scale`` of each value's block.

    Used by the fp32 indexer path on cached prefix keys and by tests; the
    production kernel consumes bytes and scales directly.
    """
    _check_index_k_dequant(key_bytes, scales)
    return select("index_k_dequant", key_bytes.device.type, index_k_dequant_reference)(key_bytes, scales)


@index_k_dequant.register_fake
def _index_k_dequant_fake(key_bytes, scales):
    _check_index_k_dequant(key_bytes, scales)
    return key_bytes.new_empty(tuple(key_bytes.shape), dtype=torch.float32)


# ------------------------------------------- index_k_page_pack / unpack
def _check_index_k_page_pack(keys: Tensor, page_size: int) -> None:
    check_page_size("index_k_page_pack", page_size)
    check_tensor("index_k_page_pack", "keys", keys, dtype=FLOATS, ndim=2)
    n = keys.shape[0]
    if isinstance(n, int) and n % page_size:
        raise ValueError(
            f"cpgraph.index_k_page_pack: argument 'keys' must hold whole pages, got {n} rows for page_size {page_size}"
        )


def index_k_page_pack_reference(keys: Tensor, page_size: int) -> Tensor:
    n, d = keys.shape
    pages = n // page_size
    q, scales = quantize_blocks(keys)
    return torch.cat([q.view(pages, page_size * d), scales.view(torch.uint8).reshape(pages, -1)], dim=1)


@torch.library.custom_op("cpgraph::index_k_page_pack", mutates_args=())
def index_k_page_pack(keys: Tensor, page_size: int) -> Tensor:
    """Pack whole pages of index keys ``[P * page_size, D]`` into ``uint8 [P, page_size * (D + 4 nb)]``.

    Page layout: ``page_size * D`` e4m3 bytes (token-major), then
    ``page_size * nb`` fp32 scales (token-major).  This is the unit HiCache
    backs up and PD transfer sends, so it is a contract, not an internal detail.
    """
    _check_index_k_page_pack(keys, page_size)
    return select("index_k_page_pack", keys.device.type, index_k_page_pack_reference)(keys, page_size)


@index_k_page_pack.register_fake
def _index_k_page_pack_fake(keys, page_size):
    _check_index_k_page_pack(keys, page_size)
    n, d = keys.shape
    nb = (d + SCALE_BLOCK - 1) // SCALE_BLOCK
    return keys.new_empty((n // page_size, page_size * (d + 4 * nb)), dtype=torch.uint8)


def check_index_pages(op: str, name: str, pages: Tensor, page_size: int, head_dim: int) -> None:
    """``pages`` must be ``uint8 [P, page_size * (head_dim + 4 nb)]`` (shared with the paged ops)."""
    check_page_size(op, page_size)
    if isinstance(head_dim, bool) or not isinstance(head_dim, (int, torch.SymInt)) or (
        isinstance(head_dim, int) and head_dim < 1
    ):
        raise ValueError(f"cpgraph.{op}: argument 'head_dim' must be a positive int, got {head_dim!r}")
    check_tensor(op, name, pages, dtype=torch.uint8, shape=(None, index_k_page_bytes(page_size, head_dim)))


def index_k_page_unpack_reference(pages: Tensor, page_size: int, head_dim: int) -> Tensor:
    p = pages.shape[0]
    nb = num_scale_blocks(head_dim)
    split = page_size * head_dim
    key_bytes = pages[:, :split].reshape(p * page_size, head_dim)
    scales = pages[:, split:].contiguous().view(torch.float32).reshape(p * page_size, nb)
    return dequantize_blocks(key_bytes, scales)


@torch.library.custom_op("cpgraph::index_k_page_unpack", mutates_args=())
def index_k_page_unpack(pages: Tensor, page_size: int, head_dim: int) -> Tensor:
    """Decode fp8 index pages ``uint8 [P, W]`` into keys ``f32 [P * page_size, head_dim]``."""
    check_index_pages("index_k_page_unpack", "pages", pages, page_size, head_dim)
    return select("index_k_page_unpack", pages.device.type, index_k_page_unpack_reference)(
        pages, page_size, head_dim
    )


@index_k_page_unpack.register_fake
def _index_k_page_unpack_fake(pages, page_size, head_dim):
    check_index_pages("index_k_page_unpack", "pages", pages, page_size, head_dim)
    return pages.new_empty((pages.shape[0] * page_size, head_dim), dtype=torch.float32)
