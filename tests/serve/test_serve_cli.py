"""``cpgraph serve`` refuses bad flags with one line and exit status 2, before loading anything."""

from __future__ import annotations

import pytest

from cpgraph.cli import main

BAD = [
    (["--model", "no-such-model"], "neither a local checkpoint directory nor a bundled model"),
    (["--model", "tiny-glm5", "--page", "24"], "--page must be a power of two"),
    (["--model", "tiny-glm5", "--port", "70000"], "--port must be in [0, 65535]"),
    (["--model", "tiny-glm5", "--host", "example.com"], "--host must be an IP address"),
    (["--model", "tiny-glm5", "--token-budget", "8"], "--token-budget must be at least a page"),
    (["--model", "tiny-glm5", "--chunk-tokens", "24"], "--chunk-tokens must be a multiple of the page size"),
    (["--model", "tiny-glm5", "--cp", "2", "--backend", "eager"], "a CP group needs aot_eager or inductor"),
    (["--model", "tiny-glm5", "--cuda-graphs", "--device", "cpu"], "--cuda-graphs captures on cuda"),
    (["--model", "tiny-glm5", "--num-pages", "0"], "--num-pages must be >= 1"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[m.split()[0] for _, m in BAD])
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("cpgraph serve: error:") and err.count("\n") == 1, err


BAD_WARM = [
    (["--model", "tiny-glm5", "--cuda-graphs", "--warmup-prefix-tokens", "-1"], "--warmup-prefix-tokens must be >= 0"),
    (["--model", "tiny-glm5", "--warmup-prefix-tokens", "64"], "--warmup-prefix-tokens applies to the --cuda-graphs"),
    (["--model", "tiny-glm5", "--own-kv-buckets"], "--own-kv-buckets applies to the --cuda-graphs"),
]


@pytest.mark.parametrize("argv,message", BAD_WARM, ids=["negative", "prefix-without-graphs", "own-without-graphs"])
def test_bad_warm_up_flags_are_one_line_errors(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("cpgraph serve: error:") and err.count("\n") == 1, err


@pytest.mark.parametrize("extra,prefix,derive", [([], None, True),
                                                 (["--warmup-prefix-tokens", "0"], 0, True),
                                                 (["--warmup-prefix-tokens", "1024", "--own-kv-buckets"], 1024, False)])
def test_warm_up_flags_reach_the_spec(extra, prefix, derive):
    from cpgraph.cli import build_parser
    from cpgraph.cli_serve import spec_from_args

    args = build_parser().parse_args(["serve", "--model", "tiny-glm5", "--device", "cuda", "--cuda-graphs", *extra])
    spec = spec_from_args(args)  # checks the flags only: no model is loaded, no GPU is needed
    assert (spec.warmup_prefix_tokens, spec.derive_kv_bucket) == (prefix, derive)


@pytest.mark.parametrize("extra,on_loop", [([], True), (["--engine-thread-only"], False)])
def test_the_idle_fast_path_flag_reaches_the_server(extra, on_loop):
    from cpgraph.cli import build_parser
    from cpgraph.cli_serve import spec_from_args

    from cpgraph.models import from_pretrained
    from cpgraph.serve.node import _server, build_engine, make_forward

    spec = spec_from_args(build_parser().parse_args(["serve", "--model", "tiny-glm5", "--num-pages", "64", *extra]))
    assert spec.idle_steps_on_loop is on_loop
    model = from_pretrained("tiny-glm5").eval()
    server = _server(build_engine(model, make_forward(model, spec), spec), spec, 0)  # built, not started
    assert server.idle_steps_on_loop is on_loop


def test_draft_flag_errors(tmp_path, capsys):
    import json
    import shutil
    from pathlib import Path

    import cpgraph.models

    ckpt = tmp_path / "no-mtp"  # a checkpoint whose config declares no MTP layer
    ckpt.mkdir()
    shutil.copy(Path(cpgraph.models.__file__).parent / "configs" / "tiny-glm5.json", ckpt / "config.json")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert main(["serve", "--model", str(ckpt), "--draft"]) == 2
    err = capsys.readouterr().err
    assert "declares no MTP layer" in err and err.count("\n") == 1, err


def test_draft_flag_reaches_the_served_engine():
    """``--draft`` on one device, built as ``serve_single`` builds it: the engine runs the draft after the target
    and each choice names the draft's guess, as ``run_prefill`` with the served first token computes it."""
    import sys
    from pathlib import Path

    import torch

    from cpgraph.cli import build_parser
    from cpgraph.cli_serve import spec_from_args
    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import make_layout
    from cpgraph.runtime.engine import run_prefill
    from cpgraph.serve.node import _server, build_engine, make_draft, make_forward

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from serve_utils import post

    spec = spec_from_args(build_parser().parse_args(["serve", "--model", "tiny-glm5", "--draft", "--device", "cpu",
                                                     "--warmup-tokens", "20", "--port", "0"]))
    assert spec.draft
    model = from_pretrained(spec.model, draft=True).eval()
    model.kv_layout = make_layout(model, spec.kv_format, spec.page_size)
    engine = build_engine(model, make_forward(model, spec), spec, draft=make_draft(model, spec))
    assert engine.cache.pool.config.num_layers == model.config.num_hidden_layers + 1
    server = _server(engine, spec, 0).start_background()
    try:
        server.wait_ready()
        prompt = torch.randint(0, 512, (45,), generator=torch.Generator().manual_seed(5)).tolist()
        status, body = post(server.url, {"prompt": prompt, "temperature": 0.0})
        assert status == 200, body
        choice = body["choices"][0]
        ref = run_prefill(lambda *a, **k: model(*a, **k), model, [prompt], page_size=spec.page_size,
                          draft=model.draft_module(), draft_tokens=choice["token_ids"])
        assert choice["token_ids"] == [int(ref.logits[0].argmax())]
        assert choice["draft_token_ids"] == [int(ref.draft_logits[0].argmax())]
    finally:
        server.stop()
