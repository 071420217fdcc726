"""``docs/cli.md``, generated from the ``cpgraph`` argparse definitions.

Why generated: a hand-written flag list drifts from the parser.  The page is
rebuilt with ``python -m cpgraph.cli --dump-docs > docs/cli.md`` and a test
compares it with :func:`render_cli_docs` of the current parser.  Each
command and each flag needs a worked example here; rendering fails if one is
missing, so a new flag cannot ship undocumented.
"""

from __future__ import annotations

import argparse

from cpgraph.cli_serve import EXAMPLES as _SERVE_EXAMPLES

# A worked example per command (key None) and per flag.  Every line is a
# complete command that the parser accepts (tested).
EXAMPLES: dict[str, dict[str | None, str]] = {
    "cpgraph": {
        "--verbose": "cpgraph -v run --model tiny-glm5",
    },
    "plan": {
        None: "cpgraph plan --prefix 0,128 --extend 1000,37 --cp 4 --page 64",
        "--prefix": "cpgraph plan --prefix 0,64 --extend 100,10",
        "--extend": "cpgraph plan --extend 1000,37",
        "--cp": "cpgraph plan --extend 1000 --cp 8",
        "--page": "cpgraph plan --extend 1000 --page 16",
        "--row-align": "cpgraph plan --extend 1000,37 --row-align 64",
        "--json": "cpgraph plan --extend 1000,37 --json",
    },
    "run": {
        None: "cpgraph run --model tiny-glm5 --prefix-lens 64,0,0,16 --cp 2",
        "--model": "cpgraph run --model tiny-deepseek-v32",
        "--prompt": "cpgraph run --model ./GLM-5 --prompt 'The capital of France is' --prompt 'def fib(n):'",
        "--prompts-file": "cpgraph run --model tiny-glm5 --prompts-file prompts.json",
        "--prefix-lens": "cpgraph run --model tiny-glm5 --prefix-lens 64,0,0,16",
        "--kv-format": "cpgraph run --model tiny-deepseek-v32-fp8 --kv-format fp8",
        "--dtype": "cpgraph run --model tiny-glm5 --dtype bfloat16",
        "--weights": "cpgraph run --model ./DeepSeek-V3.2 --device cuda --dtype bfloat16 --weights fp8",
        "--batch-size": "cpgraph run --model tiny-glm5 --batch-size 2",
        "--top": "cpgraph run --model tiny-glm5 --top 3",
        "--json": "cpgraph run --model tiny-glm5 --json out.json",
        "--quiet": "cpgraph run --model tiny-glm5 --quiet",
        "--cp": "cpgraph run --model tiny-glm5 --cp 2",
        "--device": "cpgraph run --model tiny-glm5 --device cuda",
        "--backend": "cpgraph run --model tiny-glm5 --cp 2 --backend aot_eager",
        "--cache": "cpgraph run --model tiny-glm5 --cache",
        "--evict": "cpgraph run --model tiny-glm5 --cache --evict",
        "--cache-layout": "cpgraph run --model tiny-glm5 --cache --evict --cache-layout page_first",
        "--write-policy": "cpgraph run --model tiny-glm5 --cache --evict --write-policy write_back",
        "--l3": "cpgraph run --model tiny-glm5 --cache --l3 file:/var/cache/cpgraph-l3,max_bytes=64G",
        "--cuda-graphs": "cpgraph run --model tiny-glm5 --device cuda --cache --cuda-graphs",
        "--draft": "cpgraph run --model ./DeepSeek-V3.2 --device cuda --dtype bfloat16 --draft",
        "--deterministic": "cpgraph run --model tiny-glm5 --prefix-lens 16,0 --cp 2 --backend aot_eager --deterministic",
    },
    "memory": {
        None: "cpgraph memory --model-config ./DeepSeek-V3.2 --cp 8 --ep 8 --tokens 131072 --dtype fp8 --kv-format fp8",
        "--model-config": "cpgraph memory --model-config tiny-glm5 --tokens 4096",
        "--tokens": "cpgraph memory --model-config ./GLM-5/config.json --tokens 131072 --cp 8",
        "--cp": "cpgraph memory --model-config ./GLM-5 --tokens 131072 --cp 8",
        "--ep": "cpgraph memory --model-config ./GLM-5 --tokens 131072 --cp 8 --ep 8",
        "--row-bucket": "cpgraph memory --model-config ./GLM-5 --tokens 131072 --cp 8 --row-bucket 4096",
        "--dtype": "cpgraph memory --model-config ./DeepSeek-V3.2 --tokens 131072 --cp 8 --dtype fp8",
        "--kv-format": "cpgraph memory --model-config ./DeepSeek-V3.2 --tokens 131072 --cp 8 --kv-format fp8",
        "--index-format": "cpgraph memory --model-config ./GLM-5 --tokens 131072 --cp 8 --index-format fp8",
        "--page": "cpgraph memory --model-config tiny-glm5 --tokens 4096 --page 16",
        "--deterministic": "cpgraph memory --model-config ./DeepSeek-V3.2 --tokens 131072 --cp 8 --deterministic",
        "--experts-provider": "cpgraph memory --model-config ./DeepSeek-V3.2 --tokens 32768 --dtype fp8 "
                              "--experts-provider triton",
        "--json": "cpgraph memory --model-config tiny-glm5 --tokens 4096 --json",
    },
    "launch": {
        None: "cpgraph launch --model ./DeepSeek-V3.2 --prompts-file prompts.json --cp 8",
        "--model": "cpgraph launch --model ./GLM-5",
        "--prompts-file": "cpgraph launch --model tiny-glm5 --prompts-file 'batch_{group}.json'",
        "--prefix-lens": "cpgraph launch --model tiny-glm5 --prefix-lens 64,0,0,16",
        "--cp": "cpgraph launch --model tiny-glm5 --cp 2",
        "--ep": "cpgraph launch --model tiny-glm5 --cp 2 --ep 1",
        "--device": "cpgraph launch --model tiny-glm5 --device cpu",
        "--backend": "cpgraph launch --model tiny-glm5 --backend aot_eager",
        "--kv-format": "cpgraph launch --model tiny-deepseek-v32-fp8 --kv-format fp8",
        "--dtype": "cpgraph launch --model tiny-glm5 --dtype bfloat16",
        "--weights": "cpgraph launch --model ./DeepSeek-V3.2 --cp 8 --ep 8 --dtype bfloat16 --weights fp8",
        "--repeat": "cpgraph launch --model tiny-glm5 --repeat 3",
        "--deterministic": "cpgraph launch --model ./DeepSeek-V3.2 --device cuda --deterministic",
        "--timeout": "cpgraph launch --model tiny-glm5 --timeout 1800",
        "--top": "cpgraph launch --model tiny-glm5 --top 3",
        "--json": "cpgraph launch --model tiny-glm5 --json out.json",
        "--quiet": "cpgraph launch --model tiny-glm5 --quiet",
    },
    "pd": {
        None: "cpgraph pd --cp 2 --prefix-lens 32,0,0,64",
        "--model": "cpgraph pd --model tiny-deepseek-v32 --cp 1",
        "--cp": "cpgraph pd --cp 1",
        "--prompts-file": "cpgraph pd --prompts-file prompts.json",
        "--prefix-lens": "cpgraph pd --prefix-lens 32,0,0,64",
        "--chunk-tokens": "cpgraph pd --cp 1 --chunk-tokens 32",
        "--page": "cpgraph pd --page 32",
        "--group": "cpgraph pd --group 2",
        "--backend": "cpgraph pd --backend inductor",
        "--tol": "cpgraph pd --tol 1e-3",
        "--timeout": "cpgraph pd --timeout 300",
        "--json": "cpgraph pd --json pd.json",
        "--quiet": "cpgraph pd --quiet",
    },
    "serve": _SERVE_EXAMPLES,  # kept beside the serve parser (cpgraph/cli_serve.py)
}

_INTRO = """\
# The `cpgraph` command

<!-- Generated from the argparse definitions in cpgraph/cli*.py (assembled by cpgraph.cli.build_parser) by
     `python -m cpgraph.cli --dump-docs > docs/cli.md`; tests/test_cli_docs.py fails when it is stale. -->

Subcommands: `plan` (how a batch is split over a CP group), `memory` (per-rank bytes of a CP
prefill from a model config: weights, KV, activation peak), `run` (prefill prompts on one device or
a CP group it spawns, compared with one device), `pd` (CP prefill, Mooncake KV transfer to a decode
process, one decode step checked against transformers), `launch` (one rank of a `torchrun` job:
data-parallel CP groups on one node or many; see [launch.md](launch.md)), `serve` (a long-running
prefill node with an OpenAI-compatible HTTP API; see [serve.md](serve.md)).

Errors: a bad flag, prompt, checkpoint or output path is reported as ONE line on stderr,
`cpgraph <command>: error: <what>`, with exit status 2, before any rank is spawned or model
compiled. A list value that starts with `-` must be attached with `=`: `--prefix-lens=-16,0`.

`prompts.json` in the examples holds a JSON list of token-id lists, e.g. `[[1, 2, 3, 4], [9, 8, 7]]`.

Text prompts (`cpgraph run` only): `--prompt TEXT`, or strings in the prompts file. The file is either
one JSON array of prompts or JSON Lines, one prompt per non-blank line; a prompt is a JSON list of
token ids (`[1, 2, 3]`) or a JSON string of text (`"The capital of France is"`): the quotes are
what make it text, so a line is never guessed. Text is encoded in the parent process (CP ranks get
ids) by the checkpoint directory's own tokenizer (transformers' `AutoTokenizer`, local files only,
no remote code); the top next tokens are then printed decoded beside their ids. A bundled tiny
model or a checkpoint without tokenizer files takes token ids only (one-line error, exit 2).

`cpgraph run` also reports the bytes of weights each rank holds (parameters + buffers of its model,
so only its own experts under expert parallelism) next to its KV bytes, and once which provider
computed each cpgraph op that ran (`reference` = the torch reference; on `cuda` the Triton/FlashMLA
providers, bound on the first CUDA op call (docs/ops.md); `CPGRAPH_PROVIDERS=reference` forces the
references).
"""


def _flag_actions(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _long_flag(a: argparse.Action) -> str:
    return max(a.option_strings, key=len)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _value(a: argparse.Action) -> str:
    """The value a flag takes (its defaults are stated in its help text)."""
    if a.nargs == 0:
        return ""
    value = "{" + ",".join(map(str, a.choices)) + "}" if a.choices else a.metavar or a.dest.upper()
    return f"{value} (required)" if a.required else value


def _table(p: argparse.ArgumentParser, examples: dict, skip: set[str]) -> list[str]:
    rows = ["| flag | value | what | example |", "|---|---|---|---|"]
    for a in _flag_actions(p):
        flag = _long_flag(a)
        if flag in skip:
            continue
        if flag not in examples:
            raise KeyError(f"cpgraph.cli_docs.EXAMPLES[{p.prog!r}] has no example for {flag}")
        names = ", ".join(f"`{s}`" for s in a.option_strings)
        rows.append(f"| {names} | {_cell(_value(a))} | {_cell(a.help or '')} | `{examples[flag]}` |")
    return rows


def render_cli_docs(parser: argparse.ArgumentParser) -> str:
    """The whole ``docs/cli.md`` for ``parser`` (the parser :func:`cpgraph.cli.build_parser` returns)."""
    lines = [_INTRO, "## Global flags", "", "They go before the subcommand (`-v` is also accepted after it).", ""]
    lines += _table(parser, EXAMPLES["cpgraph"], set())
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in subs._choices_actions}
    for name, sp in subs.choices.items():
        ex = EXAMPLES[name]
        about = helps.get(name) or ""
        lines += ["", f"## `cpgraph {name}`", "", f"{about[:1].upper()}{about[1:]}.", "", "```bash", ex[None], "```",
                  ""]
        lines += _table(sp, ex, {_long_flag(a) for a in _flag_actions(parser)})
    return "\n".join(lines) + "\n"
