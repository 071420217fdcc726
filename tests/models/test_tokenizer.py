"""Text prompts: the checkpoint's own tokenizer from local files; id-only models say so."""

from __future__ import annotations

import json

import pytest
import torch

from cpgraph.models import from_pretrained, prefill_logits
from cpgraph.models.tokenizer import decode_ids, encode_prompts, load_tokenizer

WORDS = ["<s>", "[UNK]", "the", "cache", "pages", "are", "owned", "by", "one", "rank"]


def save_tokenizer(root) -> None:
    """A word-level tokenizer over WORDS that prepends <s>, saved the way checkpoints ship one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", unk_token="[UNK]")
    tok.save_pretrained(str(root))


def test_encode_and_decode_through_the_saved_tokenizer(tmp_path):
    save_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    ids = encode_prompts(tok, ["the cache pages", "owned by one rank", "the moon"])
    assert ids == [[0, 2, 3, 4], [0, 6, 7, 8, 9], [0, 2, 1]]
    assert encode_prompts(tok, ["the cache"], add_special_tokens=False) == [[2, 3]]
    assert decode_ids(tok, ids[0], skip_special_tokens=True) == "the cache pages"
    assert decode_ids(tok, ids[:2], skip_special_tokens=True) == ["the cache pages", "owned by one rank"]
    assert decode_ids(tok, torch.tensor([2, 3])) == "the cache"


def test_text_prompts_run_through_a_checkpoint(tmp_path):
    model = from_pretrained("tiny-glm5")
    model_dir = tmp_path / "ckpt"
    from safetensors.torch import save_file

    from cpgraph.models.config import bundled_config_dict

    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(bundled_config_dict("tiny-glm5")))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(model_dir / "model.safetensors"))
    save_tokenizer(model_dir)
    loaded = from_pretrained(model_dir)
    tok = load_tokenizer(model_dir)
    ids = encode_prompts(tok, ["the cache pages are owned by one rank"], vocab_size=loaded.config.vocab_size)
    assert torch.equal(prefill_logits(loaded, ids), prefill_logits(model, ids))


@pytest.mark.parametrize(
    "where,needle",
    [
        ("bundled", "bundled model 'tiny-glm5' has no tokenizer"),
        ("empty", "has no tokenizer files (tokenizer.json, tokenizer_config.json"),
        ("missing", "is not a checkpoint directory"),
        ("corrupt", "cannot load the tokenizer in"),
    ],
)
def test_missing_or_bad_tokenizer_says_token_ids_are_required(tmp_path, where, needle):
    path = {"bundled": "tiny-glm5", "empty": tmp_path, "missing": tmp_path / "nope", "corrupt": tmp_path}[where]
    if where == "corrupt":
        (tmp_path / "tokenizer.json").write_text("{not json")
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(ValueError) as err:
        load_tokenizer(path)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_prompt_errors(tmp_path):
    save_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="prompts must be a list of strings"):
        encode_prompts(tok, "the cache")
    with pytest.raises(ValueError, match="prompt 1 must be a string"):
        encode_prompts(tok, ["the", 3])
    with pytest.raises(ValueError, match="prompt 0 encodes to no tokens"):
        encode_prompts(tok, [""], add_special_tokens=False)
    with pytest.raises(ValueError, match="token id 8, outside the model's vocabulary of 8"):
        encode_prompts(tok, ["one rank"], vocab_size=8)


def test_tokenizer_without_transformers_is_a_one_line_error(tmp_path, monkeypatch):
    """transformers is optional: a checkpoint's tokenizer then needs it, said in one line, not an ImportError."""
    import sys

    save_tokenizer(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    with pytest.raises(ValueError) as err:
        load_tokenizer(tmp_path)
    assert "needs transformers" in str(err.value) and "\n" not in str(err.value)
