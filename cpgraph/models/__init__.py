"""DeepSeek-V3.2 and GLM-5 ("MoE-DSA") models on cpgraph ops.

* :func:`from_pretrained` / :func:`from_hf` / :func:`tiny_model` build a
  :class:`DSAForCausalLM` (local files or in-memory transformers models only);
* :func:`prefill_logits` runs a batch of prompts (optionally a cached prefix
  first, then the rest as an extend) and returns fp32 last-token logits;
* :func:`load_tokenizer` / :func:`encode_prompts` / :func:`decode_ids` turn
  text into token ids and back with a checkpoint's own tokenizer.

See ``docs/models.md``.
"""

from .batch import BatchMeta, KVLayout, build_batch
from .config import DSAConfig, bundled_names
from .loading import WeightLoadError, build_model, from_hf, from_pretrained, init_random, load_state, tiny_model
from .model import DSAForCausalLM, ForwardOutput
from .prefill import DEFAULT_PAGE_SIZE, PrefillResult, prefill, prefill_logits
from .tokenizer import decode_ids, encode_prompts, load_tokenizer

__all__ = [
    "DSAConfig",
    "DSAForCausalLM",
    "ForwardOutput",
    "BatchMeta",
    "KVLayout",
    "build_batch",
    "bundled_names",
    "WeightLoadError",
    "build_model",
    "from_hf",
    "from_pretrained",
    "init_random",
    "load_state",
    "tiny_model",
    "DEFAULT_PAGE_SIZE",
    "PrefillResult",
    "prefill",
    "prefill_logits",
    "decode_ids",
    "encode_prompts",
    "load_tokenizer",
]
