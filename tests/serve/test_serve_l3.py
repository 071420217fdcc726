"""``cpgraph serve --l3``: a restarted server (fresh engine, same page store) serves a prompt's prefix from L3.

Real HTTP on loopback.  Server one computes the prompt and, under
``write_through``, stores its pages; stopping it drains and flushes.  Server
two starts with an empty L1/L2 over the same ``file:`` directory: the same
prompt reports cached tokens from the ``l3`` tier and the same logprobs
(within the serve tests' ``TOL``: the warm pass runs another batch shape).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_utils import get, logprob_table, metric, post  # noqa: E402
from test_serve import PAGE, TOL, _forward  # noqa: E402  (model and one_thread: conftest.py)

from cpgraph.runtime.prefill_engine import PrefillEngine  # noqa: E402
from cpgraph.runtime.scheduler import SchedulerConfig  # noqa: E402
from cpgraph.serve.app import PrefillServer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _serve(model, store):
    engine = PrefillEngine(_forward(model), model, num_pages=64, page_size=PAGE, host_pages=64, l3=store,
                           scheduler=SchedulerConfig(token_budget=128))
    return PrefillServer(engine, served=("tiny-glm5",)).start_background()


def test_a_restarted_server_serves_the_prefix_from_l3(model, tmp_path):
    store = f"file:{tmp_path}"
    prompt = list(range(3, 3 + 5 * PAGE + 3))  # 5 whole pages and a tail
    body = {"prompt": prompt, "max_tokens": 1, "logprobs": 5}
    first = _serve(model, store)
    try:
        status, cold = post(first.url, body)
        assert status == 200, cold
        assert cold["choices"][0]["prefill"]["cached_tokens"]["l3"] == 0
    finally:
        first.stop()  # drain, flush L3, close the store
    second = _serve(model, store)
    try:
        status, warm = post(second.url, body)
        assert status == 200, warm
        tiers = warm["choices"][0]["prefill"]["cached_tokens"]
        # The 5 whole pages come from L3 (none from L1/L2); the 3-token tail is computed.
        assert tiers == {"device": 0, "host": 0, "l3": 5 * PAGE}, tiers
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * PAGE
        assert warm["choices"][0]["prefill"]["computed_tokens"] == len(prompt) - 5 * PAGE
        _, page = get(second.url, "/metrics")
        assert metric(page, "cpgraph_cached_tokens_total", 'tier="l3"') == 5 * PAGE
        assert warm["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
        a, b = logprob_table(cold["choices"][0]), logprob_table(warm["choices"][0])
        assert a.keys() == b.keys()
        for tok in a:
            assert abs(a[tok] - b[tok]) <= TOL, (tok, a[tok], b[tok])
    finally:
        second.stop()


def test_serve_l3_flag_errors(tmp_path):
    from cpgraph.cli import build_parser
    from cpgraph.cli_serve import spec_from_args
    from cpgraph.runtime.inputs import InputError
    from cpgraph.runtime.storage import SpecError

    p = build_parser()
    with pytest.raises(InputError, match="--host-pages"):
        spec_from_args(p.parse_args(["serve", "--model", "tiny-glm5", "--l3", f"file:{tmp_path}"]))
    with pytest.raises(SpecError, match="L3 spec 'nosuch:x'"):  # run --l3's parser and message
        spec_from_args(p.parse_args(["serve", "--model", "tiny-glm5", "--host-pages", "8", "--l3", "nosuch:x"]))
    spec = spec_from_args(p.parse_args(["serve", "--model", "tiny-glm5", "--host-pages", "8", "--l3",
                                        f"file:{tmp_path}"]))
    assert spec.l3 == f"file:{tmp_path}"
