"""Record codecs against records built by hand (numpy + struct, no torch casts).

The hand encoder below knows e4m3 only from its definition (1 sign, 4
exponent bits with bias 7, 3 mantissa bits, no infinities, 0x7F/0xFF = NaN)
and rounds to nearest, ties to even, by brute force over the 127 magnitudes.

Error bounds used (e4m3 has 3 mantissa bits): for a value ``v = x / scale``
in the normal range (``|v| >= 2**-6``) the cast error is at most half an ulp,
``2**-4 * |v|``; below it (subnormals, spacing ``2**-9``) at most ``2**-10``.
So ``|dequant(x) - x| <= max(2**-4 * |x|, 2**-10 * scale)``, and the
power-of-two scale satisfies ``224 < amax / scale <= 448`` unless the 1e-4
floor is active.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck

import cpgraph.ops.codecs  # noqa: F401  (registers the ops)

ops = torch.ops.cpgraph


# ----------------------------------------------------------- hand codecs
def _e4m3_table() -> np.ndarray:
    """Magnitude of every non-NaN positive code 0x00..0x7E."""
    vals = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals)


E4M3 = _e4m3_table()


def enc_e4m3(v: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even e4m3 codes of float64 values with ``|v| <= 448``."""
    v = np.asarray(v, dtype=np.float64).ravel()
    mag = np.abs(v)
    assert mag.max(initial=0) <= 448
    dist = np.abs(mag[:, None] - E4M3[None, :])
    best = dist.min(axis=1, keepdims=True)
    cand = dist == best
    even = cand & (np.arange(0x7F)[None, :] % 2 == 0)
    code = np.where(even.any(axis=1), even.argmax(axis=1), cand.argmax(axis=1))
    return (code | (np.signbit(v) << 7)).astype(np.uint8)


def dec_e4m3(codes: np.ndarray) -> np.ndarray:
    codes = np.asarray(codes, dtype=np.int64)
    mag = E4M3[codes & 0x7F]
    return np.where(codes & 0x80, -mag, mag)


def hand_scale(block: np.ndarray) -> float:
    """Smallest power of two ``s`` with ``448 * s >= max(amax, f32(1e-4))`` (exact)."""
    amax = max(float(np.abs(block).max(initial=0)), float(np.float32(1e-4)))
    k = -140
    while 448.0 * 2.0**k < amax:
        k += 1
    return 2.0**k


def bf16_bits(x: float) -> int:
    """bf16 bit pattern of an fp32 value (round to nearest even), via struct; every NaN -> 0x7FC0."""
    if math.isnan(x):
        return 0x7FC0
    (u,) = struct.unpack("<I", struct.pack("<f", x))
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16


def hand_quant_row(row: np.ndarray) -> tuple[bytes, list[float]]:
    """e4m3 bytes and per-128-block scales of one fp32 row.

    Non-finite rule: the scale comes from the finite values; +-inf are
    stored as the largest magnitude (0x7E | sign), every NaN as 0x7F.
    """
    out, scales = b"", []
    for b0 in range(0, len(row), 128):
        with np.errstate(invalid="ignore"):  # signalling NaNs widen quietly
            block = row[b0 : b0 + 128].astype(np.float64)
        finite = np.isfinite(block)
        s = hand_scale(np.where(finite, block, 0.0))
        scales.append(s)
        codes = enc_e4m3(np.where(finite, block, 0.0) / s)
        codes = np.where(np.isinf(block), 0x7E | (np.signbit(block) << 7), codes)
        codes = np.where(np.isnan(block), 0x7F, codes).astype(np.uint8)
        out += codes.tobytes()
    return out, scales


def hand_mla_record(latent: np.ndarray, k_pe: np.ndarray) -> bytes:
    q, scales = hand_quant_row(latent)
    rec = q + struct.pack("<4f", *scales) + struct.pack("<64H", *[bf16_bits(float(x)) for x in k_pe])
    assert len(rec) == 656
    return rec


def hand_index_page(keys: np.ndarray) -> bytes:
    """One index-K page: all key bytes token-major, then all scales token-major."""
    key_part, scale_part = b"", b""
    for row in keys:
        q, scales = hand_quant_row(row)
        key_part += q
        scale_part += struct.pack(f"<{len(scales)}f", *scales)
    return key_part + scale_part


def _latent(n: int, seed: int) -> torch.Tensor:
    """Latent rows with a wide dynamic range per tile (exercises subnormals and the eps floor)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 512, generator=g) * torch.logspace(-3, 2, 4).repeat_interleave(128)
    x[:, 5] = 1e-7  # tiny values inside a large tile -> e4m3 subnormal / zero
    if n > 1:
        x[1, 128:256] = 3e-6  # amax below the 1e-4 floor
    return x


# ------------------------------------------------------------ MLA FP8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_fp8_pack_matches_hand_record(dtype):
    latent = _latent(4, 0).to(dtype)
    k_pe = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    rec = ops.mla_fp8_pack(latent, k_pe)
    assert rec.shape == (4, 656) and rec.dtype == torch.uint8
    lat_np, pe_np = latent.float().numpy(), k_pe.float().numpy()
    for i in range(4):
        want = hand_mla_record(lat_np[i], pe_np[i])
        assert rec[i].numpy().tobytes() == want, f"row {i}"


def f32_from_bits(bits: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(bits, dtype=np.uint32).view(np.float32))


def _non_finite_latent() -> torch.Tensor:
    """Rows with +-inf and NaNs (both signs, odd payloads) among finite values of every range."""
    x = _latent(6, 7)
    neg_nan = f32_from_bits([0xFFC00000, 0x7F800001, 0xFFFFFFFF])
    x[0, 3] = float("inf")  # one inf in a tile: the other values keep their fine scale
    x[0, 200] = float("-inf")
    x[1, 0:128] = float("inf")  # a tile of infinities only: scale from the 1e-4 floor
    x[2, 7] = float("nan")
    x[2, 300:303] = neg_nan  # negative NaN, signalling NaN, all-ones NaN
    x[3, 128:256] = float("nan")  # a tile of NaNs only
    x[4, 0], x[4, 1] = float("nan"), float("inf")
    x[5, 400] = 3e38  # finite and huge next to an inf in the same tile
    x[5, 401] = float("-inf")
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mla_fp8_pack_non_finite_rule(dtype):
    """+-inf -> 0x7E/0xFE, NaN -> 0x7F, tile scale from finite values; RoPE NaN -> bf16 0x7FC0."""
    latent = _non_finite_latent()
    if dtype == torch.float16:
        latent[5, 400] = 6e4  # 3e38 does not exist in fp16
    latent = latent.to(dtype)
    k_pe = torch.randn(6, 64, generator=torch.Generator().manual_seed(2))
    k_pe[0, 0], k_pe[0, 1], k_pe[1, 2] = float("nan"), float("inf"), float("-inf")
    k_pe[2, 3] = f32_from_bits([0xFFC00001])[0]  # negative NaN with a payload
    k_pe = k_pe.to(dtype if dtype != torch.bfloat16 else torch.float32)
    rec = ops.mla_fp8_pack(latent, k_pe)
    lat_np, pe_np = latent.float().numpy(), k_pe.float().numpy()
    for i in range(latent.shape[0]):
        assert rec[i].numpy().tobytes() == hand_mla_record(lat_np[i], pe_np[i]), f"row {i}"
    dense = ops.mla_fp8_unpack(rec, torch.float32)
    scale0 = rec[0, 512:516].view(torch.float32)[0]
    assert dense[0, 3] == 448 * scale0 and dense[0, 200] == -448 * rec[0, 516:520].view(torch.float32)[0]
    assert scale0 < 1  # the inf did not blow the tile's scale up: finite values keep their precision
    assert torch.isnan(dense[2, 7]) and torch.isnan(dense[2, 300])


def test_mla_fp8_pack_bf16_rope_is_copied_bit_for_bit():
    """bf16 RoPE input keeps its exact bits, NaN payloads included (no rounding happens)."""
    latent = torch.randn(2, 512)
    k_pe = torch.randn(2, 64).to(torch.bfloat16)
    k_pe.view(torch.int16)[1, :3] = torch.tensor([-64, 0x7FC1, -1], dtype=torch.int16)  # 0xFFC0, 0x7FC1, 0xFFFF
    rec = ops.mla_fp8_pack(latent, k_pe)
    assert torch.equal(rec[:, 528:], k_pe.contiguous().view(torch.uint8))


def test_index_k_non_finite_rule():
    keys = _non_finite_latent()[:, :256].clone()
    q, scales = ops.index_k_quant(keys)
    for i, row in enumerate(keys.numpy()):
        want_q, want_s = hand_quant_row(row)
        assert q[i].numpy().tobytes() == want_q and scales[i].tolist() == want_s, f"row {i}"
    pages = ops.index_k_page_pack(keys, 2)
    assert pages.numpy().tobytes() == b"".join(hand_index_page(keys[p : p + 2].numpy()) for p in range(0, 6, 2))


def test_mla_fp8_byte_positions():
    """Scales sit at bytes 512-527 and RoPE bf16 at 528-655, read back with struct."""
    latent = torch.zeros(1, 512)
    latent[0, 0], latent[0, 128], latent[0, 300], latent[0, 511] = 448.0, 1.0, -3.5, 0.25
    k_pe = torch.arange(64, dtype=torch.float32).unsqueeze(0) - 32.0
    raw = ops.mla_fp8_pack(latent, k_pe)[0].numpy().tobytes()
    assert struct.unpack("<4f", raw[512:528]) == (1.0, 2.0**-8, 2.0**-7, 2.0**-10)
    assert list(struct.unpack("<64H", raw[528:656])) == [bf16_bits(float(v)) for v in range(-32, 32)]
    assert raw[0] == 0x7E  # 448 / 1 -> largest finite e4m3
    assert raw[128] == 0x78  # 1.0 / 2**-8 = 256 = 2**8 -> exponent 15, mantissa 0
    assert raw[300] == 0xFE  # -3.5 / 2**-7 = -448 -> sign | largest finite
    assert raw[511] == 0x78  # 0.25 / 2**-10 = 256
    assert raw[1:128].count(0) == 127


def test_mla_fp8_unpack_matches_hand_decode_and_bounds():
    latent, k_pe = _latent(3, 2), torch.randn(3, 64)
    rec = ops.mla_fp8_pack(latent, k_pe)
    out = ops.mla_fp8_unpack(rec, torch.float32)
    assert out.shape == (3, 576) and out.dtype == torch.float32
    raw = rec.numpy()
    for i in range(3):
        scales = struct.unpack("<4f", raw[i, 512:528].tobytes())
        want = dec_e4m3(raw[i, :512]) * np.repeat(scales, 128)
        np.testing.assert_array_equal(out[i, :512].numpy(), want.astype(np.float32))
        bits = struct.unpack("<64H", raw[i, 528:656].tobytes())
        pe = [struct.unpack("<f", struct.pack("<I", b << 16))[0] for b in bits]
        np.testing.assert_array_equal(out[i, 512:].numpy(), np.array(pe, dtype=np.float32))
        # error bound and scale range
        x = latent[i].double().numpy()
        s = np.repeat(scales, 128)
        assert np.all(np.abs(want - x) <= np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * s))
        for t in range(4):
            amax = np.abs(x[t * 128 : (t + 1) * 128]).max()
            if amax >= 1e-4:
                assert 224 < amax / scales[t] <= 448
            else:
                assert scales[t] == hand_scale(np.array([1e-4]))
    assert (out[:, 512:] - k_pe).abs().max() <= 2.0**-8 * k_pe.abs().max()  # bf16: 8 bits of precision


def test_mla_fp8_unpack_dtype_and_zero_record():
    rec = ops.mla_fp8_pack(_latent(2, 3), torch.randn(2, 64))
    f32, bf = ops.mla_fp8_unpack(rec, torch.float32), ops.mla_fp8_unpack(rec, torch.bfloat16)
    assert bf.dtype == torch.bfloat16
    assert torch.equal(bf, f32.to(torch.bfloat16))
    zero = ops.mla_fp8_unpack(torch.zeros(1, 656, dtype=torch.uint8), torch.float32)
    assert torch.equal(zero, torch.zeros(1, 576))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 4), log_mag=st.floats(-6, 6), seed=st.integers(0, 2**16))
def test_mla_fp8_round_trip_bound(n, log_mag, seed):
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(n, 512, generator=g) * 10.0**log_mag
    k_pe = torch.randn(n, 64, generator=g)
    out = ops.mla_fp8_unpack(ops.mla_fp8_pack(latent, k_pe), torch.float32)
    amax = latent.abs().view(n, 4, 128).amax(-1, keepdim=True)
    scale = torch.tensor([hand_scale(a.numpy()) for a in amax.view(-1)]).view(n, 4, 1)
    err = (out[:, :512] - latent).view(n, 4, 128).abs()
    assert torch.all(err <= torch.maximum(2.0**-4 * latent.view(n, 4, 128).abs(), 2.0**-10 * scale))


# ------------------------------------------------------------ dense pack
def test_mla_dense_pack():
    latent, k_pe = torch.randn(3, 32), torch.randn(3, 16)
    out = ops.mla_dense_pack(latent, k_pe)
    np.testing.assert_array_equal(out.numpy(), np.concatenate([latent.numpy(), k_pe.numpy()], axis=1))
    mixed = ops.mla_dense_pack(latent.to(torch.bfloat16), k_pe)
    assert mixed.dtype == torch.bfloat16 and mixed.shape == (3, 48)
    assert torch.equal(mixed[:, 32:], k_pe.to(torch.bfloat16))


# --------------------------------------------------------------- index-K
@pytest.mark.parametrize("d", [32, 128, 160, 256])
def test_index_k_quant_matches_hand(d):
    keys = torch.randn(5, d, generator=torch.Generator().manual_seed(d)) * torch.linspace(0.01, 50, d)
    key_bytes, scales = ops.index_k_quant(keys)
    nb = math.ceil(d / 128)
    assert key_bytes.shape == (5, d) and key_bytes.dtype == torch.uint8
    assert scales.shape == (5, nb) and scales.dtype == torch.float32
    for i in range(5):
        q, s = hand_quant_row(keys[i].numpy())
        assert key_bytes[i].numpy().tobytes() == q
        assert scales[i].tolist() == s
    deq = ops.index_k_dequant(key_bytes, scales)
    want = np.stack([dec_e4m3(key_bytes[i].numpy()) * np.repeat(scales[i].numpy(), 128)[:d] for i in range(5)])
    np.testing.assert_array_equal(deq.numpy(), want.astype(np.float32))
    per_value = scales.repeat_interleave(128, dim=1)[:, :d]
    assert torch.all((deq - keys).abs() <= torch.maximum(2.0**-4 * keys.abs(), 2.0**-10 * per_value))


@pytest.mark.parametrize("page_size,d", [(64, 128), (4, 32), (2, 256), (1, 160), (8, 64)])
def test_index_k_page_pack_matches_hand(page_size, d):
    pages = 3
    keys = torch.randn(pages * page_size, d, generator=torch.Generator().manual_seed(page_size + d))
    packed = ops.index_k_page_pack(keys, page_size)
    nb = math.ceil(d / 128)
    assert packed.shape == (pages, page_size * (d + 4 * nb))
    if (page_size, d) == (64, 128):
        assert packed.shape[1] == 8448
    for p in range(pages):
        want = hand_index_page(keys[p * page_size : (p + 1) * page_size].numpy())
        assert packed[p].numpy().tobytes() == want
    unpacked = ops.index_k_page_unpack(packed, page_size, d)
    assert torch.equal(unpacked, ops.index_k_dequant(*ops.index_k_quant(keys)))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 6), d=st.sampled_from([16, 32, 96, 128, 200]), log_mag=st.floats(-5, 5))
def test_index_k_round_trip_bound(n, d, log_mag):
    keys = torch.randn(n, d) * 10.0**log_mag
    key_bytes, scales = ops.index_k_quant(keys)
    deq = ops.index_k_dequant(key_bytes, scales)
    per_value = scales.repeat_interleave(128, dim=1)[:, :d]
    assert torch.all((deq - keys).abs() <= torch.maximum(2.0**-4 * keys.abs(), 2.0**-10 * per_value))


# ---------------------------------------------------------------- opcheck
def _opcheck(op, args):
    result = opcheck(op.default, args)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("n,dtype", [(1, torch.float32), (5, torch.bfloat16), (0, torch.float16)])
def test_opcheck_mla(n, dtype):
    latent, k_pe = torch.randn(n, 512).to(dtype), torch.randn(n, 64).to(dtype)
    _opcheck(ops.mla_fp8_pack, (latent, k_pe))
    _opcheck(ops.mla_fp8_unpack, (ops.mla_fp8_pack(latent, k_pe), dtype))
    _opcheck(ops.mla_dense_pack, (torch.randn(n, 8 + n).to(dtype), k_pe))


@pytest.mark.parametrize("n,d,page_size", [(4, 32, 2), (8, 128, 4), (3, 160, 1)])
def test_opcheck_index_k(n, d, page_size):
    keys = torch.randn(n, d)
    _opcheck(ops.index_k_quant, (keys,))
    _opcheck(ops.index_k_dequant, ops.index_k_quant(keys))
    _opcheck(ops.index_k_page_pack, (keys, page_size) if n % page_size == 0 else (keys[:0], page_size))
    packed = ops.index_k_page_pack(keys[: n - n % page_size], page_size)
    _opcheck(ops.index_k_page_unpack, (packed, page_size, d))


# -------------------------------------------------------------- bad input
def test_bad_dtype():
    with pytest.raises(ValueError, match="'latent'"):
        ops.mla_fp8_pack(torch.zeros(2, 512, dtype=torch.int32), torch.zeros(2, 64))
    with pytest.raises(ValueError, match="'records'"):
        ops.mla_fp8_unpack(torch.zeros(2, 656), torch.float32)
    with pytest.raises(ValueError, match="'dtype'"):
        ops.mla_fp8_unpack(torch.zeros(2, 656, dtype=torch.uint8), torch.int64)
    with pytest.raises(ValueError, match="'scales'"):
        ops.index_k_dequant(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.float16))
    with pytest.raises(ValueError, match="'keys'"):
        ops.index_k_quant(torch.zeros(2, 32, dtype=torch.int64))


def test_bad_rank():
    with pytest.raises(ValueError, match="'keys'"):
        ops.index_k_quant(torch.zeros(2, 4, 32))
    with pytest.raises(ValueError, match="'latent'"):
        ops.mla_dense_pack(torch.zeros(8), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="'pages'"):
        ops.index_k_page_unpack(torch.zeros(36, dtype=torch.uint8), 1, 32)


def test_bad_shape():
    with pytest.raises(ValueError, match="'latent'"):
        ops.mla_fp8_pack(torch.zeros(2, 576), torch.zeros(2, 64))
    with pytest.raises(ValueError, match="'k_pe'"):
        ops.mla_fp8_pack(torch.zeros(2, 512), torch.zeros(3, 64))
    with pytest.raises(ValueError, match="'k_pe'"):
        ops.mla_dense_pack(torch.zeros(2, 8), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="'scales'"):
        ops.index_k_dequant(torch.zeros(2, 256, dtype=torch.uint8), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="whole pages"):
        ops.index_k_page_pack(torch.zeros(6, 32), 4)
    with pytest.raises(ValueError, match="'pages'"):
        ops.index_k_page_unpack(torch.zeros(2, 128, dtype=torch.uint8), 4, 32)


def test_bad_page_size_and_head_dim():
    for bad in (0, 3, -4, 12):
        with pytest.raises(ValueError, match="'page_size'"):
            ops.index_k_page_pack(torch.zeros(12, 32), bad)
    with pytest.raises(ValueError, match="'head_dim'"):
        ops.index_k_page_unpack(torch.zeros(2, 36, dtype=torch.uint8), 1, 0)


def test_device_mix():
    with pytest.raises(ValueError, match="one device"):
        ops.mla_fp8_pack(torch.zeros(2, 512), torch.zeros(2, 64, device="meta"))
    with pytest.raises(ValueError, match="one device"):
        ops.index_k_dequant(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 1, device="meta"))
