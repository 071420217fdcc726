"""The prompt ids' checks of ``parse_completion`` and the engine's ``submit(..., checked=True)`` (no server)."""

from __future__ import annotations

import numpy as np
import pytest

from cpgraph.serve.protocol import ApiError, parse_completion


def _parse(prompt, vocab=512):
    return parse_completion({"prompt": prompt}, served=("m",), vocab=vocab, max_prompt_tokens=10_000)


@pytest.mark.parametrize("prompt,j", [([1, -1, 600], 1), ([1, 2, 512], 2), ([2**70, -5], 0), ([3, 2**63], 1),
                                      ([[1, 2], [0, 511, 512, -1]], 2)])
def test_an_id_out_of_range_names_the_first_bad_one(prompt, j):
    with pytest.raises(ApiError) as exc:
        _parse(prompt)
    lists = prompt if isinstance(prompt[0], list) else [prompt]
    bad = next(p for p in lists if not all(0 <= t < 512 for t in p))
    assert exc.value.status == 400 and exc.value.param == "prompt"
    assert f"[{j}] = {bad[j]} is not a token id in [0, 512)" in exc.value.message


def test_checked_ids_are_int64_arrays():
    comp = _parse([[0, 511, 7], [5]])
    assert [p.dtype for p in comp.prompts] == [np.int64, np.int64]
    assert [p.tolist() for p in comp.prompts] == [[0, 511, 7], [5]]


def test_submit_checked_takes_the_array_and_checks_anything_else():
    import torch

    from cpgraph.models import from_pretrained
    from cpgraph.models.prefill import make_layout
    from cpgraph.runtime.prefill_engine import PrefillEngine, engine_request

    model = from_pretrained("tiny-glm5").eval()
    model.kv_layout = make_layout(model, "bf16", 16)
    engine = PrefillEngine(lambda *a, **k: model(*a, **k), model, num_pages=64)
    ids = _parse(list(range(40))).prompts[0]
    a, b = engine.submit(engine_request(ids), checked=True), engine.submit(engine_request(ids))
    engine.run_until_idle()
    assert a.result.status == b.result.status == "finished" and a.result.token == b.result.token
    # Not an int64 array: checked as usual, whatever the flag says.
    bad = engine.submit(engine_request([1, engine.vocab]), checked=True)
    assert bad.result.status == "refused" and bad.result.refusal == "invalid"
    bad32 = engine.submit(engine_request(np.array([1, -2], dtype=np.int32)), checked=True)
    assert bad32.result.status == "refused" and bad32.result.refusal == "invalid"
