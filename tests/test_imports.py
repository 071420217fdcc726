"""The package's import structure: no cycles, imports point down the layers, and ``import cpgraph.ops`` is light.

The import graph is built from the source with ``ast`` (nothing is
imported), over every ``cpgraph/**/*.py``:

* every ``import`` / ``from ... import`` statement counts, at module level
  and inside functions (``if TYPE_CHECKING:`` blocks excepted: they never
  run).  Why function-level imports count: a function can run at import
  time (``kernels/p2p.py`` used to call its registration at the bottom of
  the module, which is how ``ops`` -> ``kernels`` -> ``p2p`` -> ``ops`` was
  an import-time cycle that no module-level import showed), and a lazy
  import is still a dependency: hiding an upward one inside a function is
  how the old cycles stayed in;
* importing ``a.b.c`` from outside package ``a.b`` also runs
  ``a/b/__init__.py``, so it adds an edge to ``a.b`` too (a sibling import
  inside ``a.b`` does not: that package is already being imported; but
  ``from . import NAME`` of a name defined in ``a/b/__init__.py`` is an
  edge to ``a.b``, whose ``__init__`` may import that very module);
* ``importlib.import_module("cpgraph...")`` / ``__import__`` with a literal
  name count like an import statement.

Imports point down the layers (:data:`LAYERS`).  The exceptions are listed
in :data:`ALLOWED_UPWARD`, each with its reason; each must exist and be
function-level (a stale or module-level entry fails).  They are left out
of the cycle search: each closes a cycle that exists only while its
function runs, and neither function runs at import time.

Checked on the tree before this test existed: it found the
``ops`` <-> ``kernels`` component (ops/__init__ imported the kernels, whose
modules import ops), ``kernels/fp8_grouped`` <-> ``kernels/moe``,
``kernels/move`` <-> ``kernels/segments``, ``models/model`` <->
``models/mtp``, and ``models/batch`` -> ``runtime/kv_pool`` pointing up.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "cpgraph"

# Import order of the package's top-level units: an import may only point to a lower layer (or
# stay inside its own unit).  Units on one layer may not import each other.
LAYERS = {
    "plan": 0,
    "ops": 1,
    "kernels": 2,
    "models": 3,
    "passes": 3,
    "runtime": 4,
    "transfer": 5,
    "adapters": 5,  # model adapters over cpgraph ops (may use the runtime; serve and the CLI above)
    "serve": 6,
    "cli": 7,  # cli.py, cli_*.py (its subcommand modules and docs), __main__.py
    "": 8,  # cpgraph/__init__.py: the lazy facade (cpgraph.compile -> passes)
}

# (importer, imported) -> why this function-level import points up the layers.
ALLOWED_UPWARD = {
    ("cpgraph.ops.providers", "cpgraph.kernels"): (
        "first-use provider binding: the op registry imports the kernels package the first time a device's "
        "providers are needed (docs/ops.md, 'Provider binding'); kernels import ops, never the reverse at import"
    ),
    ("cpgraph.models.prefill", "cpgraph.runtime.engine"): (
        "prefill / prefill_logits, the models package's one-call prefill, run the runtime's engine (which "
        "imports models lazily: a function-level cycle); found when this test was written and left as it is "
        "(moving the public cpgraph.models.prefill_logits to the runtime is its own change)"
    ),
}


# ------------------------------------------------------------------ the graph
def _modules(package: Path) -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (file, is a package __init__)}`` for every module under ``package``."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_pkg)
    return out


def _import_nodes(tree: ast.AST, text: str):
    """``(node, module_level)`` of every import statement and literal ``import_module`` call."""
    look_in_expressions = "import_module(" in text or "__import__(" in text  # else statements suffice (fast)
    found = []

    def visit(node, top: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit_one(stmt, top)
                continue
            visit_one(child, top)

    def visit_one(node, top: bool):
        if isinstance(node, (ast.Import, ast.ImportFrom)) or (isinstance(node, ast.Call) and _literal_import_call(node)):
            found.append((node, top))
            return
        if isinstance(node, ast.expr) and not look_in_expressions:
            return
        visit(node, top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, True)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _literal_import_call(call: ast.Call) -> str | None:
    fn = call.func
    name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
    if name in ("import_module", "__import__") and call.args and isinstance(call.args[0], ast.Constant):
        value = call.args[0].value
        return value if isinstance(value, str) else None
    return None


def _targets(node, module: str, is_pkg: bool, modules) -> list[str]:
    """Modules of the package this import statement loads, by name (before parent packages are added)."""
    if isinstance(node, ast.Call):
        return [_literal_import_call(node)]
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if is_pkg else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        base = ".".join(base + ([node.module] if node.module else []))
    else:
        base = node.module
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.append(sub if sub in modules else base)  # ``from pkg import submodule`` loads the submodule
    return out


@functools.lru_cache(maxsize=None)
def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, bool]]:
    """``{importer: {imported: module_level}}`` over the package (module_level: some import of it is)."""
    modules = _modules(package)
    root = package.name
    graph: dict[str, dict[str, bool]] = {name: {} for name in modules}
    for module, (path, is_pkg) in modules.items():
        own_packages = {".".join(module.split(".")[:i]) for i in range(1, len(module.split(".")) + (1 if is_pkg else 0))}
        text = path.read_text()
        for node, top in _import_nodes(ast.parse(text, str(path)), text):
            for target in _targets(node, module, is_pkg, modules):
                if target != root and not target.startswith(root + "."):
                    continue
                while target not in modules:  # ``from cpgraph.x import name``: the module is cpgraph.x
                    target = target.rsplit(".", 1)[0]
                parts = target.split(".")
                parents = [".".join(parts[:i]) for i in range(1, len(parts))]  # run first, unless running already
                for name in [p for p in parents if p not in own_packages] + [target]:
                    if name != module:
                        graph[module][name] = graph[module].get(name, False) or top
    return graph


def allowed(edge: tuple[str, str]) -> bool:
    """``edge`` is an allowed upward import, or a parent package that import loads (``a.b`` of ``a.b.c``)."""
    a, b = edge
    return any(a == src and (b == dst or dst.startswith(b + ".")) for src, dst in ALLOWED_UPWARD)


def cycles(graph: dict[str, dict[str, bool]], drop=lambda edge: False) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), edges for which ``drop`` holds left out."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:  # recursion depth <= number of modules (~150)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if drop((v, w)):
                continue
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted(found)


def describe(graph, comp: list[str]) -> str:
    edges = [f"{a} -> {b}{'' if graph[a][b] else ' (in a function)'}" for a in comp for b in sorted(graph[a]) if b in comp]
    return "\n  ".join([" <-> ".join(comp)] + edges)


def unit(module: str) -> str:
    """The top-level unit of a module: ``cpgraph.ops.rows`` -> ``ops``; the CLI files -> ``cli``."""
    parts = module.split(".")
    if len(parts) == 1:
        return ""
    return "cli" if parts[1] in ("cli", "__main__") or parts[1].startswith("cli_") else parts[1]


def upward_edges(graph) -> dict[tuple[str, str], bool]:
    """Edges from a unit to one on the same or a higher layer: ``{(importer, imported): module_level}``."""
    out = {}
    for a, targets in graph.items():
        for b, top in targets.items():
            ua, ub = unit(a), unit(b)
            if ua != ub and LAYERS[ub] >= LAYERS[ua]:
                out[(a, b)] = top
    return out


# ------------------------------------------------------------------ structure tests
def test_the_package_has_no_import_cycles():
    graph = import_graph()
    found = cycles(graph, drop=allowed)
    assert not found, "import cycles among cpgraph modules:\n" + "\n".join(describe(graph, c) for c in found)


def test_every_unit_has_a_layer():
    units = {unit(m) for m in import_graph()}
    assert units <= set(LAYERS), f"add these package units to LAYERS in {__file__}: {sorted(units - set(LAYERS))}"


def test_imports_point_down_the_layers():
    up = upward_edges(import_graph())
    unexpected = sorted(f"{a} -> {b}" for a, b in up if not allowed((a, b)))
    assert not unexpected, "imports pointing up the layers (plan < ops < kernels < models, passes < runtime < ...):\n  " + (
        "\n  ".join(unexpected)
    )


def test_allowed_upward_imports_exist_and_stay_in_functions():
    up = upward_edges(import_graph())
    for edge, why in ALLOWED_UPWARD.items():
        assert edge in up, f"{edge} is allowed but no longer imported: drop it from ALLOWED_UPWARD ({why})"
        assert not up[edge], f"{edge[0]} imports {edge[1]} at module level: the allowance is for a function-level import"


def test_the_graph_sees_function_level_and_parent_package_imports(tmp_path):
    """The builder itself: the two kinds of edge the old cycles hid behind are found."""
    pkg = tmp_path / "cpgraph"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "kernels").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "ops" / "__init__.py").write_text("from . import rows\nfrom .. import kernels\n")
    (pkg / "ops" / "rows.py").write_text("from .providers import select\n")
    (pkg / "ops" / "providers.py").write_text("")
    (pkg / "kernels" / "__init__.py").write_text("def bind():\n    from . import p2p\n")
    (pkg / "kernels" / "p2p.py").write_text("def register():\n    import cpgraph.ops.providers\n\nregister()\n")
    graph = import_graph(pkg)
    assert graph["cpgraph.kernels.p2p"] == {"cpgraph.ops": False, "cpgraph.ops.providers": False}
    assert "cpgraph.ops" not in graph["cpgraph.ops.rows"]  # a sibling import: the package is being imported already
    assert cycles(graph) == [["cpgraph.kernels", "cpgraph.kernels.p2p", "cpgraph.ops"]]


# ------------------------------------------------------------------ import cost
_PROBE = r"""
import json, os, sys
import torch
import cpgraph.ops
from cpgraph.ops import providers

facts = {"triton": "triton" in sys.modules, "kernels": sorted(m for m in sys.modules if m.startswith("cpgraph.kernels"))}
x = torch.empty(5, 3, device="meta")
facts["fake_rule"] = list(torch.ops.cpgraph.take_rows(x, torch.empty(2, dtype=torch.int64, device="meta")).shape)
os.environ["CPGRAPH_PROVIDERS"] = "reference"
facts["forced"] = [providers.select("take_rows", "cuda", lambda *a: None).name, "triton" in sys.modules]
del os.environ["CPGRAPH_PROVIDERS"]
facts["first_use"] = [providers.active_provider("take_rows", "cuda"), "triton" in sys.modules,
                      "cpgraph.kernels" in sys.modules, providers.active_provider("take_rows", "cpu")]
print(json.dumps(facts))
"""


@pytest.mark.slow
def test_importing_the_ops_imports_no_kernel_and_no_triton():
    """A fresh interpreter: ``import cpgraph.ops`` registers ops and fake rules only; CUDA binds on first use."""
    env = {k: v for k, v in os.environ.items() if k not in ("CPGRAPH_PROVIDERS", "CPGRAPH_RERANGE")}
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE.parent)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["triton"] is False and facts["kernels"] == [], facts
    assert facts["fake_rule"] == [2, 3]
    assert facts["forced"] == ["reference", False]  # CPGRAPH_PROVIDERS=reference needs no kernel
    assert facts["first_use"] == ["triton", True, True, "reference"]
