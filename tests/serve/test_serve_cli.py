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
