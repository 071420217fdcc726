"""The CP compiler: pass manager, passes and the ``torch.compile`` entry point.

See ``docs/passes.md`` for the invariants every pass keeps.
"""

from .backend import build_pass_manager, compile
from .config import CPConfig
from .lint import HostSyncError
from .manager import CPPassManager
from .recompile_limit import RecompileLimitError

__all__ = ["compile", "CPConfig", "CPPassManager", "HostSyncError", "RecompileLimitError", "build_pass_manager"]
