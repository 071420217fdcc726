"""The batched first-token pass (``first_tokens``) against the per-row reference it replaced.

Why: the engine now reads every finished row's first token from one host
copy and one ``log_softmax``; the token, its logprob and the top alternatives
must be exactly what one row at a time through torch gives (ties, NaN rows,
bf16 logits, a seeded draw included).
"""

import torch

from cpgraph.runtime.sampling import Sampling, choose_first_token, first_tokens


def _reference(row, sampling, k):
    logp = torch.log_softmax(row.float(), dim=-1)
    token = int(torch.argmax(row.float())) if sampling.greedy else None
    top = []
    if k:
        vals, ids = torch.topk(logp, k)
        top = [(int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return token, logp, top


def _same(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)  # NaN row: NaN logprobs on both sides


def test_batched_rows_match_one_row_at_a_time():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 700, generator=g) * 4
    logits[1, 17] = logits[1, 300] = 50.0  # a tie: the first maximum
    logits[2, 5] = float("nan")  # a NaN counts as the maximum, as torch.argmax
    logits[3] = 1.0  # a flat row
    ks = [0, 3, 20, 1, 0]
    out = first_tokens(logits, [Sampling()] * 5, ks)
    for j, k in enumerate(ks):
        token, logp, top = _reference(logits[j], Sampling(), k)
        assert out[j].token == token
        assert _same(out[j].logprob, float(logp[token]))
        assert [i for i, _ in out[j].top] == [i for i, _ in top]
        assert all(_same(a, b) for (_, a), (_, b) in zip(out[j].top, top))
    assert out[1].token == 17 and out[2].token == 5


def test_bf16_rows_and_single_row_wrapper():
    logits = (torch.randn(3, 64, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    for j in range(3):
        a = first_tokens(logits[j : j + 1], [Sampling()], [5])[0]
        b = choose_first_token(logits[j], Sampling(), 5)
        token, logp, top = _reference(logits[j], Sampling(), 5)
        assert a == b
        assert (a.token, a.logprob, a.top) == (token, float(logp[token]), top)


def test_seeded_draw_is_the_same_in_a_batch_and_alone():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(2))
    s = Sampling(temperature=0.9, top_p=0.8, seed=1234)
    batch = first_tokens(logits, [s, Sampling(), s, s], [2, 0, 0, 4])
    for j in (0, 2, 3):
        alone = choose_first_token(logits[j], s, [2, 0, 0, 4][j])
        assert batch[j] == alone
