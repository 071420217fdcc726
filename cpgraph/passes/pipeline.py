"""The default pass pipeline, in order.

Optimising (CP rewrite) passes first, then cleanup, then lowering/lint.
Kept as data so a user can see, reorder or disable passes by name.
"""

from __future__ import annotations

from .cleanup import eliminate_dead_code, sort_topologically
from .lint import reject_host_syncs


def default_passes():
    return [
        ("eliminate_dead_code", eliminate_dead_code),
        ("sort_topologically", sort_topologically),
        ("reject_host_syncs", reject_host_syncs),
    ]
