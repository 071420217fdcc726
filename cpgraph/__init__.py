"""cpgraph: context-parallel prefill of DeepSeek-Sparse-Attention models under torch.compile."""

__version__ = "0.1.0"
