"""Prefill -> decode KV transfer over Mooncake (see ``docs/transfer.md``).

``PrefillPeer`` (one per prefill CP rank) sends the pages its rank owns;
``DecodeSide`` receives into its own paged pool and runs a 1-token extend.
Imports of the Mooncake binding are lazy: ``pip install 'cpgraph[transfer]'``.
"""

from .decode import DecodeSide, TransferRefused, decode_meta, decode_step
from .driver import make_pool, prefill_and_send
from .engine import MooncakeEngine
from .frames import FrameError
from .layout import PoolLayout, fingerprint
from .overlap import LayerContext, LayerTransferManager, attach_layer_hooks
from .prefill import PrefillPeer
from .sender import KVSender, cap_batches, owned_runs
from .status import RoomStatus, StatusTable, agree

__all__ = [
    "DecodeSide", "FrameError", "KVSender", "LayerContext", "LayerTransferManager", "MooncakeEngine", "PoolLayout",
    "PrefillPeer", "RoomStatus", "StatusTable", "TransferRefused", "agree", "attach_layer_hooks", "cap_batches",
    "decode_meta", "decode_step", "fingerprint", "make_pool", "owned_runs", "prefill_and_send",
]
