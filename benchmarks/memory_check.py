"""Predicted (``cpgraph.plan.memory``) vs measured GPU memory of one prefill on a kernel-shaped model.

Model: the kernel-shaped DeepSeek-V3.2 config of ``cuda_graph_bench.py`` (64 heads, kv_lora
512, rope 64, indexer 64 x 128, top-k 2048, 4 layers: 1 dense + 3 MoE), random bf16 weights, on
one GPU (CP 1).  One request of ``--tokens`` tokens is prefilled in one forward.  Measured:

* weights = ``torch.cuda.memory_allocated()`` after the model is on the device, minus before;
* KV = the bytes the prefill's KV pool allocated (``EngineResult.pool_bytes``);
* activation peak = ``max_memory_allocated()`` during the prefill minus what was allocated before
  it, minus the KV pool.  The prefill runs twice and the second run is the one measured: the
  first also allocates one-time workspaces (cuBLAS, Triton autotuning; printed as ``first-run
  extra``), which stay allocated and are no activation.

The ratio measured / predicted is printed per figure.  The plan models cpgraph's eager GPU path
(on an H200 it agreed within 0.2% at 2K, 8K and 32K tokens, bf16 and FP8 KV);
``--compile`` measures the Inductor-compiled forward instead, for which the eager plan is an
upper bound (fusion frees the per-head intermediates early: 0.63x of the eager peak at 8K).

    python benchmarks/memory_check.py [--tokens 16384] [--kv-format bf16|fp8] [--compile] [--json OUT]

On a machine without CUDA (``--device cpu``) only the prediction is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_graph_bench import KERNEL_SHAPED  # noqa: E402


def kernel_shaped_model(device):
    """``cuda_graph_bench``'s model, built the way a checkpoint loads: bf16, router and indexer weights in fp32.

    (``cuda_graph_bench.kernel_shaped_model`` casts every tensor to bf16, which the plan would not predict.)
    """
    from cpgraph.models import DSAConfig, build_model, init_random
    from cpgraph.models.config import bundled_config_dict

    cfg = DSAConfig.from_hf_dict(dict(bundled_config_dict("tiny-deepseek-v32"), **KERNEL_SHAPED))
    return init_random(build_model(cfg, torch.bfloat16, device), seed=0, std=0.02)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384, help="request length (default 16384)")
    ap.add_argument("--kv-format", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--compile", action="store_true", help="measure the inductor-compiled forward")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--json", default=None, metavar="OUT")
    args = ap.parse_args()

    import cpgraph.ops  # noqa: F401  (registers the GPU kernels as providers)
    from cpgraph.models.prefill import make_layout
    from cpgraph.plan.memory import plan_memory, render_memory
    from cpgraph.runtime.engine import run_prefill

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("memory_check: no CUDA device (use --device cpu for the prediction only)")
    dev = torch.device("cuda" if cuda else "cpu")

    def allocated() -> int:
        return torch.cuda.memory_allocated(dev) if cuda else 0

    before = allocated()
    model = kernel_shaped_model(dev)
    weights_measured = allocated() - before
    cfg = model.config
    plan = plan_memory(cfg, tokens=args.tokens, cp=1, dtype="bf16", kv_format=args.kv_format, page_size=args.page)
    print(render_memory(plan))

    model.kv_layout = make_layout(model, args.kv_format, args.page)
    forward = model
    if args.compile:
        from cpgraph.passes import CPConfig, compile

        forward = compile(model, CPConfig(), backend="inductor", dynamic=False)
    prompt = [torch.randint(0, cfg.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()]

    def run():
        return run_prefill(lambda *a, **k: forward(*a, **k), model, prompt, kv_format=args.kv_format,
                           page_size=args.page)

    def measured_run():
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        start = allocated()
        res = run()
        if cuda:
            torch.cuda.synchronize(dev)
        return res, (torch.cuda.max_memory_allocated(dev) - start) if cuda else None

    _, first_peak = measured_run()  # compiles (--compile) and allocates the one-time workspaces
    res, peak = measured_run()
    kv_measured = res.pool_bytes
    act_measured = None if peak is None else peak - kv_measured

    rows = [("weights", plan.weight_bytes, weights_measured if cuda else None),
            ("kv", plan.kv_bytes, kv_measured),
            (f"activation peak ({plan.peak_phase})", plan.activation_peak, act_measured),
            ("total", plan.total_bytes, None if peak is None else weights_measured + peak)]
    print(f"\n{'figure':<34}{'predicted':>16}{'measured':>16}{'measured/predicted':>20}")
    out = {"tokens": args.tokens, "kv_format": args.kv_format, "compiled": args.compile, "device": str(dev),
           "gpu": torch.cuda.get_device_name(dev) if cuda else None, "figures": {}}
    for name, pred, meas in rows:
        ratio = None if meas is None else meas / max(pred, 1)
        print(f"{name:<34}{pred:>16,}{'n/a' if meas is None else f'{meas:,}':>16}"
              f"{'n/a' if ratio is None else f'{ratio:.3f}':>20}")
        out["figures"][name] = {"predicted": pred, "measured": meas, "ratio": ratio}
    if cuda:
        extra = first_peak - peak
        print(f"first-run extra (one-time workspaces{', compilation' if args.compile else ''}): {extra:,} B")
        out["first_run_extra"] = extra
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
