"""Adapters: other people's model code under ``cpgraph.compile``.

The CP passes rewrite a forward that meets the model contract
(``docs/model_contract.md``): it calls cpgraph's ops for everything that
mixes rows (attention, its indexer, the KV cache) and states its row
scopes.  An adapter makes a model written elsewhere meet it by swapping
only those modules for thin ones over cpgraph ops, keeping the model's own
code and parameters for everything else.

* :mod:`cpgraph.adapters.transformers` -- transformers 5.24's
  ``DeepseekV32ForCausalLM`` and ``GlmMoeDsaForCausalLM``.
"""
