"""Transfer tests: Mooncake's log follows the cpgraph logger (quiet by default) in this process.

Mooncake reads ``MC_LOG_LEVEL`` once, when it is first imported, so set it
before any test module imports the binding.
"""

from cpgraph.transfer.engine import set_log_level

set_log_level()
