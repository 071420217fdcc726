"""The PD path through ``cpgraph serve``: a decode registers a room, the request names it, the KV arrives.

The decode side is :class:`cpgraph.transfer.decode.DecodeSide` in this process
(Mooncake over TCP loopback): it asks the server where its prefill peer
listens (``GET /v1/kv_transfer``), registers a room with it (the room
protocol of docs/transfer.md), and the completion request names the room.
Each chunk's pages go out after the step that computed them; the decode's
pages must then hold exactly the prefill pool's bytes (a pure copy: bitwise),
and the aux record the first token the response reports.  The second
request hits the first one's cached pages: its first chunk also sends them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_utils import get, post  # noqa: E402

pytest.importorskip("mooncake")

from cpgraph.models import from_pretrained  # noqa: E402
from cpgraph.models.prefill import make_layout  # noqa: E402
from cpgraph.runtime.engine import pool_config  # noqa: E402
from cpgraph.runtime.hicache import payloads_of  # noqa: E402
from cpgraph.runtime.kv_pool import KVPool  # noqa: E402
from cpgraph.runtime.prefill_engine import PrefillEngine  # noqa: E402
from cpgraph.runtime.radix import TokenKey  # noqa: E402
from cpgraph.runtime.scheduler import SchedulerConfig  # noqa: E402
from cpgraph.serve.app import PrefillServer  # noqa: E402
from cpgraph.serve.node import _transfer_info  # noqa: E402
from cpgraph.serve.transfer import RoomSender  # noqa: E402
from cpgraph.transfer.decode import DecodeSide  # noqa: E402
from cpgraph.transfer.prefill import PrefillPeer  # noqa: E402
from cpgraph.transfer.sender import AUX_BYTES  # noqa: E402
from cpgraph.transfer.status import RoomStatus  # noqa: E402

PAGE = 16


@pytest.mark.parametrize("overlap, draft", [(False, False), (True, False), (True, True)],
                         ids=["after_forward", "per_layer", "per_layer_draft"])
def test_decode_room_receives_the_prefill_pool_bytes(one_thread, overlap, draft):
    """``per_layer``: the sender's hooks are on the model (``cpgraph serve`` without CUDA graphs), so each chunk
    opens before its step's forward and every layer goes out as the forward writes it (none after it).
    ``draft``: the MTP draft runs after the target (``cpgraph serve --draft``); its layer is one more layer of
    both pools, sent with the others, and each choice names the draft's guess."""
    model = from_pretrained("tiny-glm5", draft=draft).eval()
    model.kv_layout = make_layout(model, "bf16", PAGE)

    def forward(ids, meta, mla, index, **kw):
        return model(ids, meta, mla, index, **kw)

    engine = PrefillEngine(forward, model, num_pages=64, page_size=PAGE, scheduler=SchedulerConfig(token_budget=32),
                           draft=model.draft_module() if draft else None)
    engine.transfer = RoomSender(PrefillPeer(engine.cache.pool, 0))
    if overlap:
        engine.transfer.attach(model)
    assert engine.transfer.overlap == overlap
    at_commit, commit = {}, engine._commit

    def reading_commit(live):  # the prompt's whole pages, every payload, before the tree adopts or frees them
        sel = torch.as_tensor(live.pages[: len(live.tokens) // PAGE])
        at_commit[len(live.tokens)] = {name: t[sel].clone() for name, t in payloads_of(engine.cache.pool)}
        commit(live)

    engine._commit = reading_commit
    server = PrefillServer(engine, served=("tiny-glm5",),
                           transfer_info=_transfer_info(engine, [engine.transfer.address])).start_background()
    decode = DecodeSide(KVPool(pool_config(model, "bf16", PAGE, 64, 0, draft=draft)), max_rooms=8)
    try:
        server.wait_ready()
        status, info = get(server.url, "/v1/kv_transfer")
        assert status == 200 and info["page_size"] == PAGE and len(info["peers"]) == 1
        g = torch.Generator().manual_seed(41)
        first = torch.randint(0, 512, (64,), generator=g).tolist()
        second = first[:48] + torch.randint(0, 512, (32,), generator=g).tolist()
        # With a draft, the second prompt's hit gives back its last page: the first prompt's draft record at row 47
        # encodes token 48 of the first prompt, not of the second (docs/mtp.md, prefix caching).
        for room, tokens, chunks, cached in ((1, first, 2, 0), (2, second, 2, 32) if draft else (2, second, 1, 48)):
            table = decode.open_room(room, len(tokens), info["peers"])
            status, body = post(server.url, {"prompt": tokens, "kv_transfer": {"room": room}})
            assert status == 200, body
            choice = body["choices"][0]
            assert choice["prefill"]["chunks"] == chunks and choice["prefill"]["cached_tokens"]["device"] == cached
            sent = choice["kv_transfer"]
            assert sent["ok"] and sent["room"] == room and sent["bytes_sent"] > 0 and sent["peers"] == info["peers"]
            assert decode.wait(room, 30) == RoomStatus.SUCCESS
            assert decode.first_token(room) == choice["token_ids"][0]
            assert ("draft_token_ids" in choice) == draft
            # The aux record carries the draft's guess too (-1, read as None, without a draft).
            assert decode.draft_token(room) == (choice["draft_token_ids"][0] if draft else None)
            # Every page of the prompt arrived bit for bit: the pages the request computed or hit, as they stood
            # when its step ended (read at its radix commit).  Without a draft all of them sit in the radix cache.
            engine.sync()  # the answer can precede its step's commit to the radix cache
            pages = len(tokens) // PAGE
            for name, b in payloads_of(decode.pool):
                assert torch.equal(at_commit[len(tokens)][name], b[torch.as_tensor(table[:pages])]), (room, name)
            if not draft:
                src = engine.cache.tree.match_prefix(TokenKey(tokens)).device_pages
                assert src.shape[0] == pages
                for name, a in payloads_of(engine.cache.pool):
                    assert torch.equal(a[torch.as_tensor(src)], at_commit[len(tokens)][name]), (room, name)
            # The pages and the first-token record.
            assert sent["bytes_sent"] == pages * engine.cache.pool.bytes_per_page() + AUX_BYTES
            decode.release(room)
        peer = engine.transfer.peer  # 3 chunks (2 + 1; 2 + 2 with a draft) of every layer: by the hooks, or all
        layers = (4 if draft else 3) * engine.cache.pool.config.num_layers  # after the forwards
        assert engine.cache.pool.config.num_layers == model.config.num_hidden_layers + draft
        assert (peer.layers_per_layer, peer.layers_after_forward) == ((layers, 0) if overlap else (0, layers))
        # A room nobody registered is refused up front, naming the field.
        status, err = post(server.url, {"prompt": first, "kv_transfer": {"room": 7}})
        assert status == 400 and err["error"]["param"] == "kv_transfer.room"
    finally:
        server.stop()
        engine.transfer.close()
        decode.close()
