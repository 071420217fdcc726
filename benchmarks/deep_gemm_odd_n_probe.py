"""Probe: does DeepGEMM's fp8_gemm_nt take N = 576 (kv_a) and 2112 (q_a + kv_a), exactly as the reference?"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpgraph.ops  # noqa: F401,E402
from cpgraph.kernels import fp8_linear as kernel  # noqa: E402
from cpgraph.ops.fp8_linear import fp8_block_linear_reference  # noqa: E402
from fp8_linear_bench import make_case  # noqa: E402
import fp8_linear_bench as fb  # noqa: E402

fb.GRAPH = True
for M in (4096, 32768):
    for N in (576, 2112, 1536):
        x, w, ws, wb = make_case(M, N, 7168)
        try:
            def dg():
                q, s = kernel.quantize_activations(x, 128, True, scales_column_major=True)
                return kernel.deep_gemm_linear(q, s, w, ws, torch.bfloat16)
            got = dg()[:256].float()
            want = fp8_block_linear_reference(x[:256].float(), w, ws, 128, 128, True)
            err = float((got - want).abs().max() / want.abs().max())
            t_dg, t_bf = fb.time_ms(dg), fb.time_ms(lambda: x @ wb.t())
            tri = fb.time_ms(lambda: kernel.block_scaled_gemm(*kernel.quantize_activations(x, 128, True), w, ws, 128,
                                                              128, torch.bfloat16))
            print(f"M {M} N {N}: rel err {err:.2e}; deep_gemm {t_dg:.3f} ms, bf16 {t_bf:.3f}, triton {tri:.3f}: "
                  f"x bf16 {t_bf / t_dg:.2f}", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"M {M} N {N}: failed {type(exc).__name__}: {str(exc)[:300]}", flush=True)
