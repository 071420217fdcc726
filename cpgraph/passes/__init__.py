"""The CP compiler: pass manager, passes and the ``torch.compile`` entry point.

See ``docs/passes.md`` for the invariants every pass keeps and
``docs/model_contract.md`` for what a model must give the passes
(``PassMatchError`` names the rule a model breaks).
"""

from .backend import build_pass_manager, compile
from .config import CPConfig
from .graph_facts import PassMatchError
from .lint import HostSyncError
from .manager import CPPassManager
from .recompile_limit import RecompileLimitError

__all__ = ["compile", "CPConfig", "CPPassManager", "HostSyncError", "PassMatchError", "RecompileLimitError",
           "build_pass_manager"]
