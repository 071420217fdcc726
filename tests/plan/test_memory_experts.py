"""The memory plan's routed experts, per provider, against what each implementation allocates.

The brute force is written apart from the plan: :class:`LiveBytes` watches every tensor the
implementation creates (a ``TorchDispatchMode``: each op's new storages, rounded to the CUDA
allocator's 512-byte blocks, freed when the last tensor on them dies) and keeps the most bytes
live at once.  The torch reference runs as it is on CPU.  The GPU paths run their real Python
wrappers on CPU tensors with only the kernel launches replaced by no-ops (Triton launches, and
DeepGEMM's GEMMs by a stand-in that allocates what DeepGEMM's SM90 host code allocates around
its kernel); so every ``torch.empty``, dispatch plan, padded layout and gathered copy the wrappers
make is measured, and a wrapper that allocates differently fails here.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cpgraph.models.config import DSAConfig
from cpgraph.plan import memory as mem

from test_memory import DEEPSEEK_V32, GLM5  # tests/plan: pytest puts a test's directory on sys.path

BLOCK = 512  # the CUDA caching allocator's block


class LiveBytes(TorchDispatchMode):
    """Most bytes of storages created inside the mode that are live at once (``peak``); ``cur`` = live now.

    ``events``: ``(bytes, live bytes after it)`` of every new storage, in order.
    """

    def __init__(self):
        super().__init__()
        self.cur = self.peak = 0
        self.events: list[tuple[int, int]] = []
        self._refs: dict[int, int] = {}  # storage address -> tensors on it that are alive
        self._size: dict[int, int] = {}

    def _drop(self, key: int) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.cur -= self._size.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        older = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                continue
            key = t.untyped_storage().data_ptr()
            if key not in self._refs:
                if key in older:  # a view of (or in place on) a tensor from before the mode: no new memory
                    continue
                self._size[key] = -(-t.untyped_storage().nbytes() // BLOCK) * BLOCK
                self._refs[key] = 0
                self.cur += self._size[key]
                self.peak = max(self.peak, self.cur)
                self.events.append((self._size[key], self.cur))
            self._refs[key] += 1
            weakref.finalize(t, self._drop, key)
        return out


def measured(fn, *args, **kwargs) -> LiveBytes:
    with LiveBytes() as live:
        out = fn(*args, **kwargs)
    del out
    return live


SMALL = 2048  # at the tests' sizes: index vectors, dispatch masks and the like, not row buffers


def assert_books(booked: tuple[int, list], live: LiveBytes) -> None:
    """The plan's peak is the measured one, and every row buffer it books is a measured allocation made with as
    many bytes live as the plan has then (so a booking the implementation does not make, or makes at another
    moment, fails even where it is not the peak).  The plan may leave out what dies before its next booking,
    and the live bytes at a small booking (an index vector among the dispatch's transients) are not compared;
    they count in the live bytes at every row buffer after them."""
    peak, events = booked
    assert peak == live.peak
    it = iter(live.events)
    missing = [e for e in events if e[0] >= SMALL and e not in it]  # ordered subsequence
    assert not missing, (missing, live.events)


def test_live_bytes_follows_lifetimes():
    """The brute force itself: temporaries die, views keep their storage, inputs' views cost nothing."""
    x = torch.zeros(1000)

    def f(x):
        a = x * 2  # 4000 B -> 4096
        b = a[:10]  # a view: a's storage stays while b lives
        del a
        c = (x + 1) * 3  # the sum dies after the product: 4096 + 4096 at the product's moment
        del c
        return x[:5], b

    with LiveBytes() as live:
        keep = f(x)
    assert live.peak == 3 * 4096 and live.cur == 4096
    del keep


# ----------------------------------------------------------------------------- operands

M, K_TOP, E, H, I = 24, 2, 8, 256, 128  # H and I multiples of 128: every provider takes them
VALID = 20  # rows >= VALID are padding rows (num_valid)


def _operands(dtype: torch.dtype, fp8: bool, *, m=M, k=K_TOP, experts=E, ids=None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, H, generator=g).to(dtype)
    if ids is None:
        ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(m)])
    w = torch.rand(ids.shape, generator=g)
    gu = torch.randn(experts, 2 * I, H, generator=g)
    dn = torch.randn(experts, H, I, generator=g)
    nv = torch.tensor([min(VALID, m)])
    if not fp8:
        return (x, ids, w, gu.to(dtype), dn.to(dtype), nv), {}
    scales = (torch.rand(experts, 2 * I // 128, H // 128, generator=g), torch.rand(experts, H // 128, I // 128, generator=g))
    return (x, ids, w, gu.to(torch.float8_e4m3fn), dn.to(torch.float8_e4m3fn), nv, *scales, 128, 128, True), {}


def _plan(provider: str, dtype: str, *, m=M, k=K_TOP, experts=E, deterministic=False) -> tuple[int, list]:
    """``(peak, [(bytes, live bytes after it), ...])`` of one experts call as the plan books it."""
    events: list[tuple[int, int]] = []
    alloc = mem._Tape.alloc

    def record(tape, name, nbytes):
        alloc(tape, name, nbytes)
        if mem._block(int(nbytes)):
            events.append((mem._block(int(nbytes)), tape.cur))

    mem._Tape.alloc = record
    try:
        peak = mem.experts_bytes(provider, m, k, experts, H, I, dtype=dtype, deterministic=deterministic)
    finally:
        mem._Tape.alloc = alloc
    return peak, events


# ----------------------------------------------------------------------------- the torch reference


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")])
def test_reference_experts_book_what_the_dense_form_allocates(dtype, name):
    """``moe_experts_reference`` (every expert on every row: ``[E, M, 2I]``, SiLU, product, ``[E, M, H]``) as it runs."""
    from cpgraph.ops.moe import moe_experts_reference

    args, _ = _operands(dtype, False)
    assert_books(_plan("reference", name), measured(moe_experts_reference, *args))


# ----------------------------------------------------------------------------- the GPU paths, launches stubbed


class _NoLaunch:
    """A kernel that launches nothing, called as ``kernel[grid](...)`` or as a ``Launcher``."""

    def __getitem__(self, grid):
        return lambda *a, **k: None

    def __call__(self, *a, **k):
        return None


class FakeDeepGEMM:
    """DeepGEMM's SM90 m-grouped GEMMs without the kernel: what the host code allocates around it.

    From DeepGEMM's ``csrc`` (``transform_sf_into_required_layout``, ``get_mn_major_tma_aligned_tensor``):
    fp32 activation scales of 1 x 128 blocks are copied into an MN-major tensor whose MN extent is
    TMA-aligned (16 bytes: 4 floats) unless they already are; 128 x 128 weight scales are checked,
    not copied; the bf16 GEMM takes its operands as they are.  The copy lives for the call.
    """

    @staticmethod
    def _sfa(sf):
        mn, sf_k = sf.shape
        aligned = -(-mn // 4) * 4
        if sf.stride(0) == 1 and sf.stride(1) == aligned:
            return sf
        return torch.empty_strided((mn, sf_k), (1, aligned), dtype=sf.dtype)

    def m_grouped_fp8_gemm_nt_contiguous(self, a, b, d, psum, use_psum_layout=False):
        assert use_psum_layout and d.shape[0] == a[0].shape[0] == a[1].shape[0]
        self._sfa(a[1])

    def m_grouped_bf16_gemm_nt_contiguous(self, a, b, d, psum, use_psum_layout=False):
        assert use_psum_layout and d.shape[0] == a.shape[0]


@pytest.fixture
def no_launches(monkeypatch):
    """Every kernel launch the expert wrappers make becomes a no-op; their allocations stay."""
    pytest.importorskip("triton")
    from cpgraph.kernels import (deep_gemm_experts, fp8_grouped, fp8_linear, invariant_gemm, moe_combine, move,
                                 segments, swiglu)

    for module, name in ((swiglu, "_swiglu_kernel"), (fp8_grouped, "_grouped_gemm_kernel"),
                         (fp8_grouped, "_swiglu_quant_kernel"), (fp8_linear, "_quantize_kernel"),
                         (moe_combine, "_COMBINE"), (move, "_MOVE_ROWS"), (segments, "_LAUNCH"),
                         (invariant_gemm, "_grouped_kernel")):
        assert hasattr(module, name), (module.__name__, name)
        monkeypatch.setattr(module, name, _NoLaunch())
    monkeypatch.setattr(deep_gemm_experts, "load", lambda: FakeDeepGEMM())


def test_triton_bf16_experts_book_the_grouped_path(no_launches):
    """``moe_experts_grouped`` as ``kernels/moe.py`` calls it on CUDA: Triton gather, fused SwiGLU (no SiLU copy),
    Triton combine; ``torch._grouped_mm`` for the GEMMs."""
    from cpgraph.kernels.moe_combine import combine
    from cpgraph.kernels.move import take_rows
    from cpgraph.kernels.swiglu import swiglu
    from cpgraph.ops.moe import moe_experts_grouped

    args, _ = _operands(torch.bfloat16, False)
    got = measured(moe_experts_grouped, *args, combine=combine, swiglu=swiglu, take_rows=take_rows)
    assert_books(_plan("triton", "bf16"), got)
    # the eager form between the GEMMs (CPU) has its SiLU copy beside the product: a booking the fused path lacks
    eager = measured(moe_experts_grouped, *args, combine=combine, take_rows=take_rows)
    assert len(eager.events) == len(got.events) + 1 and eager.peak == got.peak  # not the peak: y comes after


def test_triton_fp8_experts_book_the_fp8_grouped_path(no_launches):
    """``kernels/fp8_grouped.moe_experts_fp8``: quantised input, gate/up, SwiGLU + quantisation in one pass, down."""
    from cpgraph.kernels.fp8_grouped import moe_experts_fp8

    args, _ = _operands(torch.bfloat16, True)
    assert_books(_plan("triton", "fp8"), measured(moe_experts_fp8, *args))


@pytest.mark.parametrize("fp8", [True, False])
def test_deep_gemm_experts_book_the_padded_layout(no_launches, fp8):
    """``kernels/deep_gemm_experts``: every buffer has ``C + 128 E`` padded rows; FP8 codes and scales gathered."""
    from cpgraph.kernels import deep_gemm_experts as dge

    args, _ = _operands(torch.bfloat16, fp8)
    fn = dge.moe_experts_fp8 if fp8 else dge.moe_experts_bf16
    assert_books(_plan("deep_gemm", "fp8" if fp8 else "bf16"), measured(fn, *args))


@pytest.mark.parametrize("fp8", [True, False])
def test_deep_gemm_books_align_rows_for_an_expert_of_one_row(no_launches, fp8):
    """One row per expert: DeepGEMM's layout spans ``ALIGN`` rows per expert, and the plan books at least that."""
    from cpgraph.kernels import deep_gemm_experts as dge
    from cpgraph.ops.moe import dispatch_plan

    assert mem.DEEP_GEMM_ALIGN == dge.ALIGN
    ids = torch.arange(E).view(E, 1)  # expert e gets row e, and only it
    plan = dispatch_plan(ids, None, E)
    pos, psum, size = dge.padded_layout(plan.group_ends, E)
    assert pos.tolist() == [e * dge.ALIGN for e in range(E)] and psum.tolist() == [e * dge.ALIGN + 1 for e in range(E)]
    assert size >= E * dge.ALIGN  # the buffers cover the layout's span
    args, _ = _operands(torch.bfloat16, fp8, m=E, k=1, ids=ids)
    name = "fp8" if fp8 else "bf16"
    booked = _plan("deep_gemm", name, m=E, k=1)
    assert_books(booked, measured(dge.moe_experts_fp8 if fp8 else dge.moe_experts_bf16, *args))
    booked = booked[0]
    # bytes a padded row costs in the buffers the plan books for every row (gate/up out, SwiGLU out, expert out,
    # and for FP8 the gathered codes and scales): ALIGN of them per expert, not one
    per_row = 2 * 2 * I + 2 * H + (H + 4 * (H // 128) + I + 4 * (I // 128) if fp8 else I * 2 + 2 * H)
    assert booked >= E * dge.ALIGN * per_row
    assert booked - _plan("triton", name, m=E, k=1)[0] >= E * (dge.ALIGN - 1) * per_row


@pytest.mark.parametrize("fp8", [True, False])
def test_deterministic_experts_book_the_invariant_provider(no_launches, monkeypatch, fp8):
    """``cpgraph::invariant_moe_experts``' provider: bf16 gathers inside its GEMM and takes an eager SwiGLU (F.silu on
    CUDA, patched in here: the CPU form computes in fp32); FP8 is the Triton FP8 path at fixed tiles."""
    from cpgraph.kernels.invariant_gemm import invariant_moe_experts
    from cpgraph.ops import invariant_core

    monkeypatch.setattr(invariant_core, "silu", F.silu)
    args, _ = _operands(torch.bfloat16, fp8)
    assert_books(_plan("triton", "fp8" if fp8 else "bf16", deterministic=True), measured(invariant_moe_experts, *args))


# ----------------------------------------------------------------------------- the MoE phase


@pytest.mark.parametrize("dtype,ep", [("bf16", 1), ("fp8", 1), ("fp8", 8)])
def test_moe_phase_moves_with_the_experts_booking(dtype, ep):
    """At V3.2's sizes the experts' buffers are the MoE phase's peak: the phase differs between providers by
    exactly what one experts call books (under EP: the wire rows, ``E / ep`` local experts, one route a row)."""
    cfg = DSAConfig.from_hf_dict(DEEPSEEK_V32)
    R, k, n_exp = 4096, cfg.num_experts_per_tok, cfg.n_routed_experts
    rows, routes = (R, k) if ep == 1 else (ep * R * min(k, n_exp // ep), 1)

    def phase(p):
        return mem.activation_phases(cfg, R, 65536, dtype=dtype, ep=ep, experts_provider=p)[1]["moe"]

    def booked(p):
        return mem.experts_bytes(p, rows, routes, n_exp // ep, cfg.hidden_size, cfg.moe_intermediate_size, dtype=dtype)

    assert phase("deep_gemm") - phase("triton") == booked("deep_gemm") - booked("triton") > 0


def test_v32_32k_moe_phase_per_provider():
    """V3.2, 32K tokens on one device: the FP8 paths hold less than bf16's gathered rows; DeepGEMM adds its padding
    (``128 E`` rows) and the gathered e4m3 copy; the default for both weights is DeepGEMM."""
    cfg = DSAConfig.from_hf_dict(DEEPSEEK_V32)
    plans = {(d, p): mem.plan_memory(cfg, tokens=32768, dtype=d, experts_provider=p)
             for d in ("bf16", "fp8") for p in ("triton", "deep_gemm")}
    moe = {key: plan.activation_phases["moe"] for key, plan in plans.items()}
    assert moe["fp8", "triton"] < moe["fp8", "deep_gemm"] < moe["bf16", "triton"] < moe["bf16", "deep_gemm"]
    assert mem.plan_memory(cfg, tokens=32768, dtype="fp8").experts_provider == "deep_gemm"
    assert mem.plan_memory(cfg, tokens=32768).experts_provider == "deep_gemm"  # bf16 too, since it measured faster
    assert mem.plan_memory(cfg, tokens=32768).activation_phases == plans["bf16", "deep_gemm"].activation_phases


# ----------------------------------------------------------------------------- the default and the refusals


_ODD_H, _ODD_I = dict(DEEPSEEK_V32, hidden_size=7164), dict(DEEPSEEK_V32, moe_intermediate_size=2044)


@pytest.mark.parametrize("cfg_dict,dtype", [(c, d) for c in (DEEPSEEK_V32, GLM5, _ODD_H, _ODD_I)
                                            for d in ("bf16", "fp8", "fp16", "fp32")
                                            if not (c is _ODD_I and d == "fp8")])  # FP8 experts need I % 128 == 0
def test_default_provider_is_what_the_cuda_provider_chooses(cfg_dict, dtype):
    """``default_experts_provider`` against ``kernels/moe.py``'s own rules for a CUDA tensor (SM90, DeepGEMM installed,
    ``CPGRAPH_BF16_EXPERTS`` / ``CPGRAPH_FP8_EXPERTS`` at ``auto``): the static facts they read, nothing else."""
    pytest.importorskip("triton")
    from cpgraph.kernels import deep_gemm_experts as dge
    from cpgraph.ops.moe import grouped_mm_supported

    cfg = DSAConfig.from_hf_dict(cfg_dict)
    act = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    x = SimpleNamespace(device=torch.device("cuda"), dtype=act, shape=(64, cfg.hidden_size),
                        element_size=lambda: torch.empty((), dtype=act).element_size())
    gate_up = SimpleNamespace(shape=(cfg.n_routed_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size))
    if dtype == "fp8":
        want = "deep_gemm" if dge.operand_reason(x, gate_up, None, 128, 128) is None else "triton"
    else:
        assert dge.BF16_AUTO == "deep_gemm"
        if dtype == "bf16" and cfg.hidden_size % 128 == 0 and gate_up.shape[1] % 256 == 0:
            want = "deep_gemm"  # choose_bf16's operand rule on a machine where DeepGEMM loads
        else:
            want = "triton" if grouped_mm_supported(x, gate_up) else "reference"
    assert mem.default_experts_provider(cfg, dtype) == want
    assert mem.default_experts_provider(cfg, dtype, deterministic=True) == "triton"


@pytest.mark.parametrize("kw,msg", [
    (dict(experts_provider="cutlass"), "'experts_provider' must be one of reference, triton, deep_gemm"),
    (dict(experts_provider="reference", dtype="fp8"), "dense FP8 reference .* not modelled"),
    (dict(experts_provider="deep_gemm", deterministic=True), "invariant_moe_experts"),
    (dict(experts_provider="triton", dtype="fp32"), "run the reference on CUDA"),
    (dict(experts_provider="deep_gemm", dtype="fp16"), "DeepGEMM takes bf16"),
])
def test_providers_that_cannot_run_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        mem.plan_memory(DSAConfig.from_hf_dict(DEEPSEEK_V32), tokens=4096, **kw)


def test_plan_names_its_experts_provider():
    plan = mem.plan_memory(DSAConfig.from_hf_dict(DEEPSEEK_V32), tokens=4096, dtype="fp8", experts_provider="triton")
    assert plan.experts_provider == "triton" and plan.to_dict()["experts_provider"] == "triton"
    assert "routed experts triton" in mem.render_memory(plan)
