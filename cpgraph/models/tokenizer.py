"""Text prompts through a checkpoint's own tokenizer (local files only).

A released checkpoint directory carries its tokenizer (``tokenizer.json``,
``tokenizer_config.json``, ...); transformers' ``AutoTokenizer`` reads it
with ``local_files_only=True`` and without remote code, so nothing is
downloaded or executed.  The bundled tiny models have random weights over a
made-up vocabulary and no tokenizer: they take token ids only.

``load_tokenizer(dir)`` -> tokenizer; ``encode_prompts(tok, texts)`` ->
token-id lists ready for ``prefill_logits``; ``decode_ids(tok, ids)`` ->
text.  Errors are one-line ``ValueError``s naming what is wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .config import bundled_names

# Files any transformers tokenizer is saved as; one of them must be present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_tokenizer(path):
    """The tokenizer saved in checkpoint directory ``path`` (``AutoTokenizer``, local files, no remote code).

    A bundled tiny model name or a directory without tokenizer files raises
    ``ValueError`` saying that token ids are required instead.
    """
    root = Path(path)
    if not root.is_dir():
        if str(path) in bundled_names():
            raise ValueError(
                f"bundled model {str(path)!r} has no tokenizer (random weights over a made-up vocabulary): "
                "give prompts as token ids"
            )
        raise ValueError(f"{str(path)!r} is not a checkpoint directory; a tokenizer is read from local files only")
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{root} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): give prompts as token ids"
        )
    try:  # transformers is an optional dependency (the `test` extra); the library runs on token ids without it
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(f"{root} has a tokenizer, but reading it needs transformers (pip install transformers); "
                         "or give prompts as token ids") from None
    try:
        return AutoTokenizer.from_pretrained(str(root), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises OSError, ValueError, json/tokenizers errors
        raise ValueError(f"cannot load the tokenizer in {root}: {_first_line(exc)}") from None


def encode_prompts(tok, texts: Sequence[str], *, vocab_size: int | None = None,
                   add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of each text, with the special tokens the tokenizer adds (BOS) unless told otherwise.

    ``vocab_size`` (the model's): an id the model has no embedding for
    raises, since a tokenizer saved with a larger vocabulary than the
    weights would otherwise index out of the embedding table.  A text that
    encodes to no tokens raises too (a prefill needs at least one token).
    """
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise ValueError(f"prompts must be a list of strings, got {type(texts).__name__}")
    out = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"prompt {i} must be a string, got {type(text).__name__}")
        ids = list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])
        if not ids:
            raise ValueError(f"prompt {i} encodes to no tokens")
        if vocab_size is not None:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {i} encodes to token id {bad[0]}, outside the model's vocabulary of {vocab_size}: "
                    "the tokenizer does not belong to these weights"
                )
        out.append([int(t) for t in ids])
    return out


def decode_ids(tok, ids, *, skip_special_tokens: bool = False):
    """Text of one token-id sequence, or a list of texts for a list of sequences."""
    if hasattr(ids, "tolist"):  # a tensor of generated / chosen ids, read on the host after the forward
        ids = ids.tolist()  # sync-ok: decoding is host work by definition
    seqs = [ids] if isinstance(ids, int) else list(ids)
    if seqs and all(isinstance(s, (list, tuple)) for s in seqs):
        return [tok.decode([int(t) for t in s], skip_special_tokens=skip_special_tokens) for s in seqs]
    return tok.decode([int(t) for t in seqs], skip_special_tokens=skip_special_tokens)


__all__ = ["TOKENIZER_FILES", "decode_ids", "encode_prompts", "load_tokenizer"]
