"""Per-layer manager: grouping, dedup, missed layers sent at finish, exceptions, drop drains (fake sender)."""

import threading
import time

import pytest

from cpgraph.transfer.overlap import LayerContext, LayerTransferManager


class FakeSender:
    def __init__(self, fail_on=None, slow=0.0):
        self.submits, self.sync, self.waited = [], [], []
        self.fail_on, self.slow, self.failed = fail_on, slow, False
        self.lock = threading.Lock()

    def ctx(self, key="r", layers=range(6)):
        return LayerContext(key, layers, self.submit, self.send_sync, self.wait, lambda: self.failed)

    def submit(self, layers):
        if self.fail_on is not None and self.fail_on in layers:
            raise RuntimeError("boom")
        time.sleep(self.slow)
        with self.lock:
            self.submits.append(list(layers))
        return [(len(self.submits), 1)]

    def send_sync(self, layers):
        self.sync.append(list(layers))
        return 0

    def wait(self, submitted, t0):
        self.waited.append(list(submitted))
        return 0


@pytest.mark.parametrize("group", [1, 4])
def test_grouping_and_dedup(group):
    s = FakeSender()
    m = LayerTransferManager(hooked_layers=6, group=group, workers=2, timeout=5)
    try:
        ctx = s.ctx()
        m.register(ctx)
        for _ in range(2):  # a second forward fires every layer again: dedup keeps the target at 6
            for layer in range(6):
                m.on_layer_end(layer)
        assert len(ctx.enqueued) == 6
        assert m.finish(ctx) == 0
        assert sorted(x for b in s.submits for x in b) == list(range(6))
        assert len(s.submits) == -(-6 // group) and s.sync == []
    finally:
        m.close()


def test_layers_without_hook_sent_at_finish():
    s = FakeSender()
    m = LayerTransferManager(hooked_layers=5, group=2, workers=1, timeout=5)
    try:
        ctx = s.ctx(layers=range(6))  # layer 5 (an MTP-like layer) never fires
        m.register(ctx)
        for layer in range(4):  # the forward stops before layer 4 too: 4 and 5 are missed
            m.on_layer_end(layer)
        assert m.finish(ctx) == 0
        assert sorted(x for b in s.submits for x in b) == [0, 1, 2, 3]
        assert s.sync == [[4, 5]]
    finally:
        m.close()


def test_worker_exception_counted_never_hangs():
    s = FakeSender(fail_on=2)
    m = LayerTransferManager(hooked_layers=6, group=1, workers=2, timeout=5)
    try:
        ctx = s.ctx()
        m.register(ctx)
        for layer in range(6):
            m.on_layer_end(layer)
        t0 = time.monotonic()
        assert m.finish(ctx) == -1
        assert time.monotonic() - t0 < 4 and ctx.errors == 1 and m.worker_errors == 1
    finally:
        m.close()


def test_finish_times_out_to_failure():
    s = FakeSender(slow=1.0)
    m = LayerTransferManager(hooked_layers=2, group=1, workers=1, timeout=0.2)
    try:
        ctx = s.ctx(layers=range(2))
        m.register(ctx)
        m.on_layer_end(0), m.on_layer_end(1)
        assert m.finish(ctx) == -1
    finally:
        m.close()


def test_drop_drains_then_no_more_submits():
    s = FakeSender(slow=0.05)
    m = LayerTransferManager(hooked_layers=6, group=1, workers=1, timeout=5)
    try:
        ctx = s.ctx()
        m.register(ctx)
        for layer in range(3):
            m.on_layer_end(layer)
        assert m.drop(ctx)
        assert ctx.processed == len(ctx.enqueued) == 3  # everything enqueued was drained before returning
        assert s.waited  # in-flight batches were waited
        n = len(s.submits)
        for layer in range(3, 6):
            m.on_layer_end(layer)  # the context is gone: nothing new is submitted
        time.sleep(0.1)
        assert len(s.submits) == n <= 3
    finally:
        m.close()


def test_duplicate_register_refused():
    s = FakeSender()
    m = LayerTransferManager(hooked_layers=2, workers=1)
    try:
        m.register(s.ctx("a"))
        with pytest.raises(ValueError, match="already active"):
            m.register(s.ctx("a"))
    finally:
        m.close()


def test_functional_copy_fallback_reported_once_through_the_callback(caplog):
    """A graph writing KV through copies is reported once, to the caller when it asks (``cpgraph pd`` ranks)."""
    import types

    import torch

    from cpgraph.transfer.overlap import attach_layer_hooks

    buffers = [torch.zeros(4), torch.zeros(4)]
    model = types.SimpleNamespace(model=types.SimpleNamespace(layers=[None, None]))
    pool = types.SimpleNamespace(mla_pool=lambda i: buffers[i])
    m = LayerTransferManager(hooked_layers=2, workers=1, timeout=5)
    notes = []
    handles = attach_layer_hooks(model, m, pool, on_fallback=notes.append)
    try:
        for _ in range(3):
            for layer in range(2):
                handles[0]._on_written(layer, torch.zeros(4))  # a functional copy, not the registered buffer
        assert len(notes) == 1 and "after the forward" in notes[0]
        assert handles[0].fallback_layers == 6
        assert not [r for r in caplog.records if "functional copy" in r.getMessage()]
    finally:
        for h in handles:
            h.remove()
        m.close()


def test_pd_reports_overlap_only_where_a_layer_went_per_layer():
    from cpgraph.transfer.pd import PDResult, hidden_share

    # aot_eager: every layer after the forward; two noisy tails must not read as 27 % hidden
    assert hidden_share(0.0040, 0.0029, layers_per_layer=0) == 0.0
    assert hidden_share(0.0100, 0.0010, layers_per_layer=8) == pytest.approx(0.9)
    kw = dict(first_tokens=[1], decode_logits=None, hf_logits=None, max_abs_diff=0.0, bytes_sent=1000,
              transfer_seconds=1e-3, tail_sequential=0.004, tail_overlap=0.0029, statuses=[4])
    none = PDResult(hidden_share=0.0, layers_per_layer=0, layers_after_forward=8, **kw)
    assert not none.overlap_measured and "no overlap" in none.transfer_line() and "hidden behind" not in none.transfer_line()
    some = PDResult(hidden_share=0.275, layers_per_layer=8, layers_after_forward=0, **kw)
    assert some.overlap_measured and "hidden behind the forward: 27.5%" in some.transfer_line()
