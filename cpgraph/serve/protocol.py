"""The OpenAI completions convention, as a prefill node speaks it: request checks and response objects.

Why a module of its own: every rule about what a client may send lives here,
as pure functions over parsed JSON, so each refusal (status, message, the
field it names) is testable without a server, and the HTTP layer only moves
bytes.  Errors use OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``, so existing clients surface them unchanged.

A prefill node returns the *first* token of a completion (decode generates
the rest), hence ``max_tokens`` must be 1 (absent means 1), ``n`` 1, and no
streaming.  Fields that would be silently ignored are refused unless they
hold their no-op value (a flag that does nothing is an error, not a no-op).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

MAX_LOGPROBS = 20


class ApiError(Exception):
    """A client error: HTTP ``status`` with an OpenAI-style JSON body naming ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Completion:
    """A checked ``POST /v1/completions`` body."""

    model: str
    prompts: list[list[int]]  # token ids, one list per choice
    temperature: float
    top_p: float
    logprobs: int | None
    seed: int | None
    kv_transfer: dict | None  # {"room": int}


# Accepted with their no-op value only (anything else changes what a completion means).
_NO_OP = {"echo": (False,), "stream": (False,), "best_of": (1,), "suffix": (None, ""), "stop": (None, [], ""),
          "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": (None, {}),
          "stream_options": (None,)}
_KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "logprobs", "seed", "n", "user", "kv_transfer",
          *_NO_OP}


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ApiError(400, f"{name} must be a number, got {type(v).__name__}", name)
    if v != v or v > hi or v < lo or (lo_open and v == lo):
        raise ApiError(400, f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}", name)
    return float(v)


def _int(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{name} must be an integer, got {type(v).__name__}", name)
    if not lo <= v <= hi:
        raise ApiError(400, f"{name} must be in [{lo}, {hi}], got {v}", name)
    return v


def _token_ids(value, where: str, vocab: int, typed: bool = False) -> np.ndarray:
    """The checked ids as an int64 array (what the engine takes without checking each element again).

    ``typed``: the caller has already scanned ``value``'s types (every one an ``int``).  Every pass over
    a prompt is paid on each request's path, so each is made once: one type scan, ``min`` and ``max``, one
    conversion.  The engine takes the result without checking it again (``PrefillEngine.submit(...,
    checked=True)``).
    """
    if not value:
        raise ApiError(400, f"{where} is empty", "prompt")
    if not typed and not set(map(type, value)) <= {int}:  # C-speed type scan (a bool is not a token id)
        j, t = next((j, t) for j, t in enumerate(value) if type(t) is not int)
        raise ApiError(400, f"{where}[{j}] must be a token id (an integer), got {type(t).__name__}", "prompt")
    # The range by the builtins over the list of ints (C loops, no NumPy reduction and its Python wrapper; an
    # id of any size compares exactly), then one conversion, which cannot overflow once the range holds.
    if min(value) < 0 or max(value) >= vocab:
        j = next(j for j, t in enumerate(value) if not 0 <= t < vocab)
        raise ApiError(400, f"{where}[{j}] = {value[j]} is not a token id in [0, {vocab})", "prompt")
    return np.asarray(value, dtype=np.int64)


def parse_prompts(value, encode: Callable[[str], list[int]] | None, vocab: int) -> list[np.ndarray]:
    """``prompt``: a string, a list of token ids, or a list of strings / token-id lists (one choice each)."""
    typed = False  # one list of ids whose types are scanned here already
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, list) and value and set(map(type, value)) <= {int}:  # C-speed scan (bool is not int)
        items, typed = [value], True
    elif isinstance(value, list) and value:
        items = value
    elif isinstance(value, list):
        raise ApiError(400, "prompt is an empty list", "prompt")
    else:
        raise ApiError(400, "prompt must be a string, a list of token ids, or a list of those", "prompt")
    out = []
    for i, item in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            if encode is None:
                raise ApiError(400, f"{where} is text, but this model has no tokenizer: send token ids", "prompt")
            if not item:
                raise ApiError(400, f"{where} is an empty string", "prompt")
            try:
                ids = encode(item)
            except ValueError as exc:
                raise ApiError(400, f"{where}: {' '.join(str(exc).split())}", "prompt") from None
            out.append(_token_ids(ids, where, vocab))
        elif isinstance(item, list):
            out.append(_token_ids(item, where, vocab, typed))
        else:
            raise ApiError(400, f"{where} must be a string or a list of token ids, got {type(item).__name__}",
                           "prompt")
    return out


def parse_completion(body, *, served: tuple[str, ...], vocab: int, max_prompt_tokens: int,
                     encode: Callable[[str], list[int]] | None = None) -> Completion:
    """Check a parsed JSON body; :class:`ApiError` (400, 404 or 413) naming the field otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    if not body.keys() <= _KNOWN:  # one C-speed set comparison on the usual path; sorted for a stable message
        unknown = sorted(set(body) - _KNOWN)
        raise ApiError(400, f"unknown field {unknown[0]!r}", unknown[0])
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"model must be a string, got {type(model).__name__}", "model")
    if model is not None and model not in served:
        raise ApiError(404, f"the model {model!r} does not exist here; this server serves {served[0]!r}", "model",
                       code="model_not_found")
    if not body.keys().isdisjoint(_NO_OP):  # most bodies name none of them: no loop
        for name, allowed in _NO_OP.items():
            if name in body and body[name] not in allowed:
                raise ApiError(400, f"{name} is not supported by a prefill node (allowed: {allowed[0]!r})", name)
    mt = body.get("max_tokens", 1)
    if isinstance(mt, bool) or mt != 1:
        raise ApiError(400, f"max_tokens must be 1: a prefill node returns the first token only, got {mt!r}",
                       "max_tokens")
    n = body.get("n", 1)
    if isinstance(n, bool) or n != 1:
        raise ApiError(400, f"n must be 1 (one first token per prompt), got {n!r}", "n")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, f"user must be a string, got {type(user).__name__}", "user")
    temperature = _number(body, "temperature", 0.0, 0.0, 2.0)  # absent: greedy (the engine's default)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
    seed = _int(body, "seed", 0, 2**63 - 1)
    kv = body.get("kv_transfer")
    if kv is not None:
        if not isinstance(kv, dict) or set(kv) - {"room"} or "room" not in kv:
            raise ApiError(400, 'kv_transfer must be an object {"room": <int>} naming the decode\'s registered room',
                           "kv_transfer")
        room = kv["room"]
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 2**62:
            raise ApiError(400, f"kv_transfer.room must be a non-negative integer, got {room!r}", "kv_transfer.room")
    if "prompt" not in body:
        raise ApiError(400, "prompt is required", "prompt")
    prompts = parse_prompts(body["prompt"], encode, vocab)
    if kv is not None and len(prompts) != 1:
        raise ApiError(400, "kv_transfer names one room: send one prompt with it", "kv_transfer")
    for i, p in enumerate(prompts):
        if len(p) > max_prompt_tokens:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise ApiError(413, f"{where} has {len(p)} tokens; this server takes at most {max_prompt_tokens}",
                           "prompt", code="context_length_exceeded")
    return Completion(model or served[0], prompts, temperature, top_p, logprobs, seed, kv)


def token_text(token: int, decode: Callable[[int], str] | None) -> str:
    """How a token is shown: its decoded text, or its decimal id for a model without a tokenizer."""
    return decode(token) if decode is not None else str(token)


def completion_response(req: Completion, results: list, decode: Callable[[int], str] | None) -> dict:
    """OpenAI's ``text_completion`` object for finished engine results (one per prompt, in order)."""
    choices, cached = [], 0
    for i, res in enumerate(results):
        text = token_text(res.token, decode)
        lp = None
        if req.logprobs is not None:
            top = {token_text(t, decode): v for t, v in res.top_logprobs}
            top.setdefault(text, res.logprob)  # the chosen token is always listed (up to logprobs + 1 entries)
            lp = {"tokens": [text], "token_logprobs": [res.logprob], "top_logprobs": [top], "text_offset": [0]}
        choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": "length", "token_ids": [res.token],
                  "prefill": {"prompt_tokens": res.prompt_tokens, "cached_tokens": dict(res.cached_tokens),
                              "computed_tokens": res.computed_tokens, "chunks": res.chunks,
                              "timings_ms": {k: round(v * 1e3, 3) for k, v in res.timings.items()}}}
        if res.draft_token is not None:  # a server with the MTP draft: its guess after the first token
            choice["draft_token_ids"] = [res.draft_token]
        if res.transfer is not None:
            choice["kv_transfer"] = dict(res.transfer)
        choices.append(choice)
        cached += res.cached
    prompt_tokens = sum(r.prompt_tokens for r in results)
    return {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
            "model": req.model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(results),
                      "total_tokens": prompt_tokens + len(results), "prompt_tokens_details": {"cached_tokens": cached}}}
