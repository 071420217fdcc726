"""The CP compiler: pass manager, passes and the ``torch.compile`` entry point.

See ``docs/passes.md`` for the invariants every pass keeps.
"""

from .backend import build_pass_manager, compile
from .config import CPConfig
from .lint import HostSyncError
from .manager import CPPassManager

__all__ = ["compile", "CPConfig", "CPPassManager", "HostSyncError", "build_pass_manager"]
