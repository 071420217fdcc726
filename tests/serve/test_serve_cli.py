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
    (["--model", "tiny-glm5", "--cuda-graphs", "--device", "cpu"], "--cuda-graphs applies to one device on cuda"),
    (["--model", "tiny-glm5", "--num-pages", "0"], "--num-pages must be >= 1"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[m.split()[0] for _, m in BAD])
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("cpgraph serve: error:") and err.count("\n") == 1, err
