"""``cpgraph run``: report, JSON output, prompts file, prefix lengths, text prompts, op providers, weight bytes,
``--weights``, input errors."""

from __future__ import annotations

import json

import pytest
import torch

from cpgraph.cli import main
from cpgraph.models import decode_ids, encode_prompts, from_pretrained, load_tokenizer, prefill_logits, tiny_model
from cpgraph.models.config import bundled_config_dict

from test_tokenizer import WORDS  # the tokenizer test's words (its tokenizer, with one word per remaining id)


def test_run_writes_json_matching_prefill_logits(tmp_path, capsys):
    prompts = [[1, 2, 3, 4, 5] * 7, [9, 8, 7]]
    pf = tmp_path / "prompts.json"
    pf.write_text(json.dumps(prompts))
    out = tmp_path / "out.json"
    rc = main(["run", "--model", "tiny-glm5", "--prompts-file", str(pf), "--prefix-lens", "32,0", "--json", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    assert "prompt 0: 35 tokens (prefix 32): top ids" in captured.out
    assert "bytes used" in captured.out and "extend pass" in captured.err  # report + progress
    data = json.loads(out.read_text())
    assert data["tokens"] == prompts
    ref = prefill_logits(tiny_model("tiny-glm5"), prompts, prefix_lens=[32, 0])
    got = torch.tensor(data["logits"])
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, rtol=0, atol=1e-6)
    top = ref.topk(5, dim=-1).indices.tolist()
    assert f"top ids {top[1]}" in captured.out


def test_run_builtin_prompts_fp8_batches(capsys):
    rc = main(["run", "--model", "tiny-deepseek-v32-fp8", "--kv-format", "fp8", "--batch-size", "2", "--top", "3"])
    assert rc == 0
    captured = capsys.readouterr()
    assert captured.out.count("top ids") == 4
    assert "batch 2/2" in captured.err


def test_run_input_errors_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    cases = [
        ["run", "--model", "no-such-model"],
        ["run", "--model", "tiny-glm5", "--prompts-file", str(bad)],
        ["run", "--model", "tiny-glm5", "--prompts-file", str(tmp_path / "missing.json")],
        ["run", "--model", "tiny-glm5", "--prefix-lens", "16"],  # 4 built-in prompts
        ["run", "--model", "tiny-glm5", "--prefix-lens", "5,0,0,0"],  # not a page multiple
        ["run", "--model", "tiny-glm5", "--kv-format", "fp8"],  # needs kv_lora 512 / rope 64
        ["run", "--model", "tiny-glm5", "--batch-size", "0"],  # was read as "all prompts"
    ]
    for argv in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("cpgraph run: error:") and err.count("\n") == 1 and "Traceback" not in err, err


# ----------------------------------------------------------------------------- text prompts, providers, weights
#
# A tiny checkpoint (tiny-glm5's weights saved as safetensors) with a word-level tokenizer that names every
# id of the model's vocabulary, so a top id decodes to a word the test can check.

def save_vocab_tokenizer(root, vocab: int) -> None:
    """A word-level tokenizer over WORDS + w10 .. w{vocab-1} that prepends <s> (id 0), saved like a checkpoint's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = WORDS + [f"w{i}" for i in range(len(WORDS), vocab)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", unk_token="[UNK]").save_pretrained(str(root))


def save_checkpoint(root, *, tokenizer_vocab: int | None = None) -> None:
    """tiny-glm5 as a checkpoint directory: config.json + model.safetensors (+ a tokenizer of that vocab size)."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(bundled_config_dict("tiny-glm5")))
    save_file({k: v.contiguous() for k, v in tiny_model("tiny-glm5").state_dict().items()},
              str(root / "model.safetensors"))
    if tokenizer_vocab is not None:
        save_vocab_tokenizer(root, tokenizer_vocab)


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("text-ckpt")
    save_checkpoint(root, tokenizer_vocab=bundled_config_dict("tiny-glm5")["vocab_size"])
    return root


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if the command gets as far as loading weights or spawning ranks."""
    import cpgraph.models
    import cpgraph.runtime.cp_run as cp_run

    def reached(*a, **k):
        raise AssertionError("weights were loaded or ranks spawned for an input error")

    monkeypatch.setattr(cpgraph.models, "from_pretrained", reached)
    monkeypatch.setattr(cp_run, "run_cp", reached)


def one_error_line(capsys, argv) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, (argv, err)
    assert err.startswith("cpgraph run: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_text_prompts_are_tokenized_and_top_tokens_decoded(text_ckpt, tmp_path, capsys):
    texts = ["the cache pages are owned", "by one rank"]
    out = tmp_path / "out.json"
    rc = main(["run", "--model", str(text_ckpt), "--prompt", texts[0], "--prompt", texts[1], "--top", "3",
               "--json", str(out), "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    tok = load_tokenizer(text_ckpt)
    ids = encode_prompts(tok, texts)
    assert ids == [[0, 2, 3, 4, 5, 6], [0, 7, 8, 9]]
    ref = prefill_logits(from_pretrained(text_ckpt), ids)
    top = ref.topk(3, dim=-1).indices.tolist()
    words = [decode_ids(tok, [[t] for t in row]) for row in top]
    assert all(w for row in words for w in row)  # every id of this vocabulary decodes to a word
    assert f"prompt 0 'the cache pages are owned': 6 tokens (prefix 0): top ids {top[0]} = {words[0]}" in text
    assert f"prompt 1 'by one rank': 4 tokens (prefix 0): top ids {top[1]} = {words[1]}" in text
    data = json.loads(out.read_text())
    assert data["tokens"] == ids and data["texts"] == texts
    assert data["top_ids"] == top and data["top_text"] == words
    assert torch.equal(torch.tensor(data["logits"]), ref)


def test_prompts_file_mixes_text_and_ids_line_by_line(text_ckpt, tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text('"the cache pages"\n\n[5, 6, 7, 8]\n"owned by\\none rank"\n')
    out = tmp_path / "out.json"
    assert main(["run", "--model", str(text_ckpt), "--prompts-file", str(path), "--json", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["tokens"] == [[0, 2, 3, 4], [5, 6, 7, 8], [0, 6, 7, 8, 9]]  # the \n is whitespace to this tokenizer
    assert data["texts"] == ["the cache pages", None, "owned by\none rank"]
    assert "prompt 1: 4 tokens" in text and "prompt 2 'owned by\\none rank': 5 tokens" in text
    # The same prompts as one JSON array give the same run.
    path.write_text(json.dumps(["the cache pages", [5, 6, 7, 8], "owned by\none rank"], indent=1))
    assert main(["run", "--model", str(text_ckpt), "--prompts-file", str(path), "--json", str(out), "--quiet"]) == 0
    assert json.loads(out.read_text())["logits"] == data["logits"]


def test_text_prompts_under_cp_are_tokenized_in_the_parent(text_ckpt, monkeypatch, capsys):
    import cpgraph.runtime.cp_run as cp_run

    seen = {}

    def fake_run_cp(spec, **kw):  # what the ranks would be handed; the logits are the one-device ones
        seen["spec"] = spec
        logits = prefill_logits(from_pretrained(text_ckpt), spec.prompts)
        return cp_run.CPRunResult(logits=logits, reference=logits, kv_bytes_per_rank=[1, 2], pages_per_rank=[1, 1],
                                  replicated_bytes=3, seconds=1.0, compile_seconds=1.0, ranks_agree=True,
                                  tokens_computed=9, weight_bytes_per_rank=[7, 7], providers={"sparse_mla": "triton"},
                                  provider_calls={"sparse_mla": [{"implementation": "triton", "calls": 4,
                                                                  "reason": None}]})

    monkeypatch.setattr(cp_run, "run_cp", fake_run_cp)
    assert main(["run", "--model", str(text_ckpt), "--prompt", "the cache", "--prompt", "one rank", "--cp", "2",
                 "--quiet"]) == 0
    assert seen["spec"].prompts == [[0, 2, 3], [0, 8, 9]]
    text = capsys.readouterr().out
    assert "prompt 0 'the cache': 3 tokens (prefix 0): top ids" in text and "] = ['" in text
    assert "rank 1: KV 2 bytes" in text and "; weights 7 bytes" in text
    assert "op providers on cpu (1 cpgraph ops ran" in text and "  sparse_mla: triton 4 calls" in text


@pytest.mark.parametrize("cp", [[], ["--cp", "2"]])
def test_text_without_a_tokenizer_needs_token_ids(tmp_path, capsys, no_load, cp):
    save_checkpoint(tmp_path)  # weights, no tokenizer files
    err = one_error_line(capsys, ["run", "--model", str(tmp_path), "--prompt", "the cache", *cp])
    assert "has no tokenizer files" in err and "give prompts as token ids" in err
    err = one_error_line(capsys, ["run", "--model", "tiny-glm5", "--prompt", "the cache", *cp])
    assert "bundled model 'tiny-glm5' has no tokenizer" in err and "give prompts as token ids" in err
    path = tmp_path / "p.jsonl"
    path.write_text('[1, 2, 3]\n"the cache"\n')
    err = one_error_line(capsys, ["run", "--model", "tiny-glm5", "--prompts-file", str(path), *cp])
    assert "has no tokenizer" in err


def test_text_prompt_errors(tmp_path, capsys, no_load):
    big = tmp_path / "big"
    save_checkpoint(big, tokenizer_vocab=600)  # a tokenizer with ids past the model's 512
    err = one_error_line(capsys, ["run", "--model", str(big), "--prompt", "the cache", "--prompt", "w599"])
    assert "prompt 1 encodes to token id 599, outside the model's vocabulary of 512" in err
    path = tmp_path / "p.jsonl"
    for body, needle in [
        ('"the cache"\nthe cache\n', "line 2 is not JSON"),
        ('[1, 2]\n42\n', "line 2 holds a JSON int, not a prompt"),
        ('{"prompts": [[1, 2]]}', "must hold prompts"),
        ("\n\n", "holds no prompts"),
    ]:
        path.write_text(body)
        assert needle in one_error_line(capsys, ["run", "--model", str(big), "--prompts-file", str(path)])
    err = one_error_line(capsys, ["run", "--model", str(big), "--prompt", "the", "--prompts-file", str(path)])
    assert "--prompt or with --prompts-file, not both" in err


def test_launch_prompts_file_refuses_text(tmp_path):
    from cpgraph.runtime.inputs import InputError, read_prompts

    path = tmp_path / "p.json"
    path.write_text(json.dumps([[1, 2], "the cache"]))
    with pytest.raises(InputError, match="prompt 1 is text; this command takes token ids"):
        read_prompts(str(path))
    assert read_prompts(str(path), allow_text=True) == [[1, 2], "the cache"]
    path.write_text("[1, 2, 3]")  # one list of ints: one prompt
    assert read_prompts(str(path)) == [[1, 2, 3]]


def test_run_reports_providers_and_weight_bytes(tmp_path, capsys):
    """On CPU every op that ran says reference; a provider registered for cpu shows up where it computed."""
    from cpgraph.ops.providers import register_provider, unregister_provider
    from cpgraph.ops.rows import take_rows_reference

    out = tmp_path / "out.json"
    assert main(["run", "--model", "tiny-glm5", "--json", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert {"sparse_mla", "paged_store", "paged_gather", "indexer_topk", "moe_experts"} <= data["providers"].keys()
    assert set(data["providers"].values()) == {"reference"}
    assert text.count("op providers on cpu") == 1 and "  sparse_mla: reference " in text
    model = tiny_model("tiny-glm5")
    expected = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert data["weight_bytes"] == expected and f"weights: {expected} bytes" in text
    assert data["device"] == "cpu" and data["weights"] == "dequantize"

    calls = []

    def counting_take_rows(x, index):
        calls.append(1)
        return take_rows_reference(x, index)

    register_provider("take_rows", "cpu", "counting", counting_take_rows)
    try:
        assert main(["run", "--model", "tiny-glm5", "--json", str(out), "--quiet"]) == 0
    finally:
        unregister_provider("take_rows", "cpu")
    data = json.loads(out.read_text())
    assert calls and data["providers"]["take_rows"] == "counting"
    # the counts are this run's calls, each one the provider computed
    assert data["provider_calls"]["take_rows"] == [{"implementation": "counting", "calls": len(calls), "reason": None}]
    assert f"  take_rows: counting {len(calls)} calls" in capsys.readouterr().out


def test_run_reports_a_fallback_with_its_reason_and_warns_once(tmp_path, capsys, caplog, monkeypatch):
    """A provider that hands its calls on: the report names what computed them and why, and the user sees a
    WARNING (the CLI shows WARNING and above), once, not once per call."""
    import logging

    from cpgraph.ops import ledger
    from cpgraph.ops.paged import paged_gather_reference
    from cpgraph.ops.providers import register_provider, unregister_provider

    reason = "test: this provider takes no call"

    def handing_on(pool, slots):
        ledger.fell_back("paged_gather", "cpu", "reference", reason, instead_of="handing_on")
        return paged_gather_reference(pool, slots)

    monkeypatch.setattr(ledger, "_LOGGED", set())  # warned once per process: start from none
    out = tmp_path / "out.json"
    register_provider("paged_gather", "cpu", "handing_on", handing_on)
    try:
        with caplog.at_level("WARNING", logger="cpgraph.ops"):
            assert main(["run", "--model", "tiny-glm5", "--json", str(out), "--quiet"]) == 0
    finally:
        unregister_provider("paged_gather", "cpu")
    data = json.loads(out.read_text())
    rows = data["provider_calls"]["paged_gather"]
    assert len(rows) == 1 and rows[0]["implementation"] == "reference" and rows[0]["reason"] == reason
    assert rows[0]["calls"] > 1 and data["providers"]["paged_gather"] == "reference"  # not the registered name
    assert f"  paged_gather: reference {rows[0]['calls']} calls ({reason})" in capsys.readouterr().out
    warned = [r for r in caplog.records if r.levelname == "WARNING" and reason in r.getMessage()]
    assert len(warned) == 1 and logging.getLogger("cpgraph.ops").isEnabledFor(logging.WARNING)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_cache_run_with_cuda_graphs_reports_uncounted_replays(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main(["run", "--model", "tiny-glm5", "--device", "cuda", "--cache", "--cuda-graphs", "--json", str(out),
                 "--quiet"]) == 0
    data = json.loads(out.read_text())
    assert data["cuda_graph_replays"] > 0
    assert f"+ {data['cuda_graph_replays']} CUDA-graph replay(s), not counted above" in capsys.readouterr().out
    assert data["provider_calls"]["sparse_mla"][0]["calls"] > 0  # the warm-up and capture calls are counted


def test_weight_bytes_follow_the_dtype(capsys, tmp_path):
    out = tmp_path / "out.json"
    assert main(["run", "--model", "tiny-glm5", "--dtype", "bfloat16", "--json", str(out), "--quiet"]) == 0
    model = tiny_model("tiny-glm5", dtype=torch.bfloat16)
    expected = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert json.loads(out.read_text())["weight_bytes"] == expected


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    from test_fp8_checkpoint import write_fp8_checkpoint

    root = tmp_path_factory.mktemp("fp8-ckpt")
    write_fp8_checkpoint(root, bundled_config_dict("tiny-glm5"), tiny_model("tiny-glm5").state_dict())
    return root


def test_weights_fp8_keeps_e4m3_projections(fp8_ckpt, tmp_path, capsys):
    from cpgraph.models.prefill import prefill_logits as logits_of

    out = tmp_path / "out.json"
    assert main(["run", "--model", str(fp8_ckpt), "--weights", "fp8", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    assert "fp8_block_linear's torch reference (slow" in captured.err
    data = json.loads(out.read_text())
    assert data["weights"] == "fp8" and data["providers"]["fp8_block_linear"] == "reference"
    fp8 = from_pretrained(fp8_ckpt, weights="fp8")
    dense = from_pretrained(fp8_ckpt)
    size = lambda m: sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])  # noqa: E731
    assert data["weight_bytes"] == size(fp8) < size(dense)
    assert torch.equal(torch.tensor(data["logits"]), logits_of(fp8, data["tokens"]))


@pytest.mark.parametrize("cp", [[], ["--cp", "2"]])
def test_weights_fp8_needs_an_fp8_checkpoint(tmp_path, capsys, no_load, cp):
    err = one_error_line(capsys, ["run", "--model", "tiny-glm5", "--weights", "fp8", *cp])
    assert "--weights fp8 needs an FP8 checkpoint; bundled model 'tiny-glm5'" in err
    save_checkpoint(tmp_path)
    err = one_error_line(capsys, ["run", "--model", str(tmp_path), "--weights", "fp8", *cp])
    assert "config.json has no quantization_config" in err


def test_cache_run_reports_text_weights_and_providers(text_ckpt, tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main(["run", "--model", str(text_ckpt), "--cache", "--prompt", "the cache pages are owned by one rank " * 3,
                 "--top", "2", "--json", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    tok = load_tokenizer(text_ckpt)
    assert data["top_text"] == [decode_ids(tok, [[t] for t in data["top_ids"][0]])]
    assert f"= {data['top_text'][0]}" in text and "second pass vs first pass" in text
    model = from_pretrained(text_ckpt)
    assert data["weight_bytes"] == sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert data["providers"]["sparse_mla"] == "reference" and "op providers on cpu" in text
