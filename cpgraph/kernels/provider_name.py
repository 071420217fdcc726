"""The name the Triton launchers are registered and counted under (``"triton"`` in provider reports).

A module of its own, importing nothing: the launcher modules name their
fallbacks with it and the package's binder (:mod:`cpgraph.kernels`)
registers them with it, so neither has to import the other for a string.
"""

PROVIDER_NAME = "triton"

__all__ = ["PROVIDER_NAME"]
