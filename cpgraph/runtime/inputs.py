"""Validation of a prefill request before any process is spawned or any model compiled.

Why one module: ``cpgraph run``, ``cpgraph run --cp N`` and ``cpgraph pd``
feed the same prompts, cached-prefix lengths and batch shape to code that
runs in spawned ranks.  A bad input caught there costs a model compile per
rank and surfaces as one traceback per process; caught here, in the parent,
it is one line before anything starts.  The prefill engine calls
:func:`check_prompts` too, so a library caller gets the same messages.
Text prompts are encoded here too (:func:`resolve_prompts`), so ranks only
ever see token ids and a model without a tokenizer fails before loading.

Errors are :class:`InputError` (a ``ValueError``): the CLI turns exactly
these into ``cpgraph <cmd>: error: <line>`` with exit status 2 and lets any
other exception through as the bug it is.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass

import torch

# What the transfer path imports; ``cpgraph pd`` checks it is importable before spawning.
MOONCAKE_MODULE = "mooncake"


class InputError(ValueError):
    """A problem with what the user asked for (flags, prompts, checkpoint), not a bug in cpgraph."""


@contextlib.contextmanager
def user_input(what: str | None = None):
    """Treat ValueError/TypeError/OSError raised inside as bad user input (an :class:`InputError`).

    Wrap only the phases that read and check what the user supplied (flags,
    prompts files, checkpoints); a ValueError from compiling or running the
    model is a bug and must keep its traceback.
    """
    try:
        yield
    except InputError:
        raise
    except (ValueError, TypeError, OSError) as exc:
        if isinstance(exc, OSError) and exc.strerror:
            text = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
        else:
            text = str(exc) or type(exc).__name__
        text = one_line(text)
        raise InputError(f"{what}: {text}" if what else text) from exc


def one_line(text: str) -> str:
    """Collapse a message to one line (error lines must never wrap into a second record)."""
    return " ".join(str(text).split())


def _check_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise InputError(f"{name} must be >= {minimum}, got {value}")


def check_prompts(token_lists, prefix_lens, page_size: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    """Validate prompts (non-empty token ids in ``[0, vocab)``) and their cached-prefix lengths.

    A prefix length must be a page multiple (cached prefixes are whole pages)
    and shorter than its prompt (at least one token is computed, the one whose
    logits are returned).  Returns plain int lists.
    """
    if not isinstance(token_lists, (list, tuple)) or not token_lists:
        raise InputError("prompts must be a non-empty list of token-id lists")
    lists = []
    for i, t in enumerate(token_lists):
        if isinstance(t, torch.Tensor):
            t = t.tolist()  # sync-ok (host input)
        if isinstance(t, (str, bytes, dict)) or not hasattr(t, "__iter__"):
            raise InputError(f"prompt {i} must be a list of token ids, got {type(t).__name__}")
        t = list(t)
        if not t:
            raise InputError(f"prompt {i} is empty")
        for j, v in enumerate(t):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab:
                raise InputError(f"prompt {i}, position {j}: token {v!r} is not an id in [0, {vocab}) "
                                 f"(the model's vocabulary)")
        lists.append(t)
    prefix = [0] * len(lists) if prefix_lens is None else list(prefix_lens)
    if len(prefix) != len(lists):
        raise InputError(f"prefix lengths have {len(prefix)} entries for {len(lists)} prompts")
    for i, (p, t) in enumerate(zip(prefix, lists)):
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise InputError(f"prefix length {i} must be an int >= 0, got {p!r}")
        if p % page_size:
            raise InputError(f"prefix length {i} = {p} is not a multiple of the page size {page_size}")
        if p >= len(t):
            raise InputError(f"prefix length {i} = {p} leaves no token to compute (prompt {i} has {len(t)})")
    return lists, prefix


BUILTIN_PROMPT_LENS = (96, 40, 17, 130)


def builtin_prompts(vocab: int) -> list[list[int]]:
    """Deterministic demo prompts (token ids only: bundled models have no tokenizer)."""
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in BUILTIN_PROMPT_LENS]


def read_prompts(path: str, *, allow_text: bool = False) -> list:
    """The prompts in file ``path``: token-id lists, and with ``allow_text`` also texts (``str``).

    Two layouts, told apart by whether the whole file parses as JSON:

    * one JSON array of prompts (any line breaks): ``[[1, 2, 3], [9, 8], "a text"]``;
    * JSON Lines: one prompt per non-blank line, ``[1, 2, 3]`` or ``"a text"``.

    A prompt is a JSON list of token ids or a JSON string of text; the
    quotes are what make a line text, so a text line can never be misread
    as ids (or the reverse), and a text may carry newlines (``\\n``).  A
    file that is one list of ints or one string is one prompt.  The ids
    are range-checked later (:func:`check_prompts`); texts go through the
    checkpoint's tokenizer (:func:`resolve_prompts`).
    """
    import json

    try:
        with open(path, encoding="utf-8") as f:
            body = f.read()
    except OSError as exc:
        raise InputError(f"cannot read prompts file {path!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"prompts file {path!r} is not UTF-8 text: {exc}") from None
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        prompts = []
        for n, line in enumerate(body.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                prompts.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise InputError(f"prompts file {path!r} line {n} is not JSON ({exc.msg}): write token ids as a "
                                 'JSON list [1, 2, 3] and text as a JSON string "like this"') from None
            if not isinstance(prompts[-1], (list, str)):
                raise InputError(f"prompts file {path!r} line {n} holds a JSON {type(prompts[-1]).__name__}, not a "
                                 "prompt (a JSON list of token ids or a JSON string)")
    else:
        if isinstance(data, str) or (isinstance(data, list) and data
                                     and not any(isinstance(p, (list, str, dict)) for p in data)):
            prompts = [data]  # one prompt (a one-line JSON Lines file)
        elif isinstance(data, list) and all(isinstance(p, (list, str)) for p in data):
            prompts = data
        else:
            raise InputError(f"prompts file {path!r} must hold prompts: a JSON array of token-id lists or strings, "
                             "or one JSON prompt per line")
    if not prompts:
        raise InputError(f"prompts file {path!r} holds no prompts")
    if not allow_text:
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                raise InputError(f"prompts file {path!r}: prompt {i} is text; this command takes token ids "
                                 "(a JSON list of ints per prompt)")
    return prompts


def resolve_prompts(prompts: list, model: str, vocab: int):
    """``(token-id lists, tokenizer or None)``: texts in ``prompts`` encoded by ``model``'s own tokenizer.

    The tokenizer is loaded only when some prompt is text (``str``); a
    bundled model or a checkpoint without tokenizer files then fails with
    one line saying that token ids are required.  Token-id prompts pass
    through unchanged (checked later by :func:`check_prompts`).  Runs in
    the parent process: CP ranks are handed ids.
    """
    texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
    if not texts:
        return prompts, None
    from cpgraph.models.tokenizer import encode_prompts, load_tokenizer

    with user_input():
        tok = load_tokenizer(model)
    out = list(prompts)
    for i in texts:
        try:
            out[i] = encode_prompts(tok, [prompts[i]], vocab_size=vocab)[0]
        except ValueError as exc:  # its messages number the prompts of the list it was given: one here
            raise InputError(one_line(exc).replace("prompt 0 ", f"prompt {i} ", 1)) from None
    return out, tok


def check_weights(model: str, weights: str | None, cfg=None) -> None:
    """``--weights fp8`` needs an FP8 checkpoint: refuse a bundled model or an unquantized config up front.

    ``cfg``: the model's config if already parsed (else read from
    ``config.json`` by :func:`model_config`).  The loader repeats the full
    check against the weight files; this one runs before any rank spawns.
    """
    from cpgraph.models.config import bundled_names

    if weights in (None, "dequantize"):
        return
    if weights != "fp8":
        raise InputError(f"--weights must be 'dequantize' or 'fp8', got {weights!r}")
    if str(model) in bundled_names():
        raise InputError(f"--weights fp8 needs an FP8 checkpoint; bundled model {str(model)!r} has random dense weights")
    cfg = cfg if cfg is not None else model_config(model)
    if cfg.quantization is None:
        raise InputError(f"--weights fp8 needs an FP8 checkpoint; {model}/config.json has no quantization_config")


@dataclass
class PrefillRequest:
    """A validated prefill request: what every rank will be given."""

    prompts: list[list[int]]
    prefix_lens: list[int]
    page_size: int
    cp: int


def check_batch_flags(*, page_size: int, cp: int = 1, device: str = "cpu", batch_size: int | None = None,
                      chunk_tokens: int | None = None, group: int | None = None) -> None:
    """The request's shape flags, checkable before a model or prompt is read.

    The CP group (``cp >= 1``; one GPU per rank on ``cuda``), the page size
    (a power of two), batch size, chunked-prefill chunk size (a page
    multiple) and transfer group size.
    """
    _check_int("--cp", cp)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise InputError("--device cuda: no CUDA device is visible")
        if torch.cuda.device_count() < cp:
            raise InputError(f"--cp {cp} needs {cp} GPUs (one rank per GPU); {torch.cuda.device_count()} visible")
    elif device != "cpu":
        raise InputError(f"--device must be 'cpu' or 'cuda', got {device!r}")
    _check_int("--page", page_size)
    if page_size & (page_size - 1):
        raise InputError(f"--page must be a power of two, got {page_size}")
    if batch_size is not None:
        _check_int("--batch-size", batch_size)
    if chunk_tokens is not None:
        _check_int("--chunk-tokens", chunk_tokens)
        if chunk_tokens % page_size:
            raise InputError(f"--chunk-tokens must be a multiple of the page size {page_size}, got {chunk_tokens}")
    if group is not None:
        _check_int("--group", group)


def check_request(prompts, prefix_lens, *, vocab: int, page_size: int, cp: int = 1, device: str = "cpu",
                  batch_size: int | None = None, chunk_tokens: int | None = None,
                  group: int | None = None) -> PrefillRequest:
    """The one check shared by ``run``, ``run --cp`` and ``pd``; raises :class:`InputError`.

    :func:`check_batch_flags`, then the prompts and prefix lengths
    (:func:`check_prompts`); then it plans every pass the ranks will run, so
    a request the planner would reject fails here, in the parent.
    """
    from cpgraph.plan import plan_prefill

    check_batch_flags(page_size=page_size, cp=cp, device=device, batch_size=batch_size, chunk_tokens=chunk_tokens,
                      group=group)
    lists, prefix = check_prompts(prompts, prefix_lens, page_size, vocab)
    # Dry-run the planner over the passes the engine will run (prefix pass, extend pass).
    with user_input("plan"):
        hit = [p for p in prefix if p > 0]
        if hit:
            plan_prefill([0] * len(hit), hit, cp_size=cp, page_size=page_size)
        plan_prefill(prefix, [len(t) - p for t, p in zip(lists, prefix)], cp_size=cp, page_size=page_size)
    return PrefillRequest(lists, prefix, page_size, cp)


def check_output_path(path: str | None, flag: str = "--json") -> None:
    """Fail before a run, not after it, when its output file cannot be written."""
    if path is None:
        return
    target = os.path.abspath(path)
    parent = os.path.dirname(target)
    if os.path.isdir(target):
        raise InputError(f"{flag} {path!r} is a directory; give a file name")
    if not os.path.isdir(parent):
        raise InputError(f"{flag} {path!r}: directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise InputError(f"{flag} {path!r}: directory {parent!r} is not writable")


def check_l3(spec: str, *, cuda_graphs: bool) -> None:
    """An ``--l3 SPEC`` (``run`` and ``serve`` alike): a valid store spec, and no CUDA graphs beside it."""
    from cpgraph.runtime.storage import parse_spec

    if cuda_graphs:
        raise InputError("--cuda-graphs does not take --l3 (L3 pages come back through the L2 load-back)")
    parse_spec(spec)


def check_mooncake(module: str | None = None) -> None:
    """``cpgraph pd`` needs the Mooncake transfer engine: say so before spawning anything."""
    name = module or MOONCAKE_MODULE
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise InputError(f"the Mooncake transfer engine ({name!r}) is not installed: pip install 'cpgraph[transfer]' "
                         "(CPU machines: mooncake-transfer-engine-non-cuda, which needs Debian libibverbs1)")


def model_config(model: str, allow_file: bool = False):
    """The :class:`~cpgraph.models.config.DSAConfig` of a bundled model or a checkpoint directory.

    Reads ``config.json`` only (never weights) and parses all of it
    (:meth:`DSAConfig.from_hf_dict`), so a config the ranks would refuse is
    refused here.  ``allow_file``: ``model`` may also name a ``.json`` config
    file (for commands that need the config only, never weights).
    """
    import json
    from pathlib import Path

    from cpgraph.models.config import DSAConfig, bundled_config_dict, bundled_names

    root = Path(model)
    if root.is_dir() or (allow_file and root.is_file() and root.suffix == ".json"):
        path = root / "config.json" if root.is_dir() else root
        where = str(path)
        with user_input(where):
            with open(path) as f:
                d = json.load(f)
    elif str(model) in bundled_names():
        where, d = f"bundled model {model!r}", bundled_config_dict(str(model))
    else:
        raise InputError(f"{model!r} is neither a local checkpoint directory nor a bundled model "
                         f"({', '.join(bundled_names())}); cpgraph never downloads weights")
    with user_input(where):
        return DSAConfig.from_hf_dict(d)


def model_vocab(model: str) -> int:
    """Vocabulary size of a bundled model or a checkpoint directory, from its config alone (:func:`model_config`)."""
    return model_config(model).vocab_size


def check_parallel(*, cp: int, ep: int = 1, world_size: int | None = None, num_experts: int | None = None) -> int:
    """Check the CP and EP degrees (and the world they tile); returns the data-parallel degree.

    A world of ``world_size`` ranks is ``world_size // cp`` data-parallel
    replicas of one CP group, so ``cp`` must divide it.  Expert parallelism
    spreads the routed experts over the ranks of a CP group: ``ep`` is 1
    (every rank holds every expert) or ``cp`` (each rank holds
    ``num_experts / ep``), and must divide the expert count.
    """
    _check_int("--cp", cp)
    _check_int("--ep", ep)
    if ep not in (1, cp):
        raise InputError(f"--ep must be 1 or equal to --cp ({cp}): experts are split over one CP group, got {ep}")
    if num_experts is not None and num_experts % ep:
        raise InputError(f"--ep {ep} does not divide the model's {num_experts} routed experts")
    if world_size is None:
        return 1
    _check_int("WORLD_SIZE", world_size)
    if world_size % cp:
        raise InputError(f"world size {world_size} is not divisible by --cp {cp} "
                         f"(the world is split into data-parallel copies of one CP group)")
    return world_size // cp
