"""``pyproject.toml`` declares what the package imports, and no extra drags in a conflicting torch.

CI installs ``.[test]``, so a module the package needs at run time but that
only the test extra lists passes CI and fails a user who ran
``pip install -e .`` (``safetensors`` for ``from_pretrained`` did).  An extra
that pins a wheel declaring a newer torch makes pip replace the user's torch
(the old ``gpu`` extra, ``sgl-flash-mla`` asking for torch >= 2.14.1).
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")
requirements = pytest.importorskip("packaging.requirements")

ROOT = Path(__file__).resolve().parents[1]

# Third-party modules the package imports only where their absence is handled; module -> why optional.
OPTIONAL = {
    "flash_mla": "sparse_mla provider, installed by hand with --no-deps (docs/kernels.md); else Triton",
    "deep_gemm": "FP8 experts' grouped GEMM and the opt-in indexer provider, built from source against the "
                 "installed torch (docs/ops/fp8_linear.md); else Triton",
    "mooncake": "the transfer engine, extra 'transfer'; else an error naming the extra",
    "aiohttp": "cpgraph serve's HTTP stack, extra 'serve'; cli_serve checks it first and names the extra",
    "prometheus_client": "cpgraph serve's /metrics, extra 'serve'; checked with aiohttp",
    # Not handled yet: --prompt without transformers installed ends in a ModuleNotFoundError.
    "transformers": "a checkpoint's tokenizer (--prompt) and the PD reference model (heavy, so not declared)",
}
# Wheels that must be installed with --no-deps (their metadata asks for a torch that would replace ours).
NO_DEPS_ONLY = {"sgl-flash-mla", "sgl-deep-gemm", "deepinfer-gemm"}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(reqs) -> set[str]:
    return {requirements.Requirement(r).name.lower() for r in reqs}


def _third_party_imports() -> dict[str, str]:
    """Top-level module -> one file importing it, over every import in the package (function-level included)."""
    out = {}
    for path in sorted((ROOT / "cpgraph").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for m in mods:
                top = m.split(".")[0]
                if top != "cpgraph" and top not in sys.stdlib_module_names:
                    out.setdefault(top, str(path.relative_to(ROOT)))
    return out


def test_every_required_import_is_a_runtime_dependency():
    deps = _names(_project()["dependencies"])
    dists = metadata.packages_distributions()
    missing = []
    for module, where in _third_party_imports().items():
        if module in OPTIONAL:
            continue
        names = {d.lower() for d in dists.get(module, [module])}
        if not names & deps:
            missing.append(f"{module} (imported in {where}; distribution {', '.join(sorted(names))})")
    assert not missing, "imported but not in [project] dependencies: " + "; ".join(missing)


def test_optional_imports_are_still_imported():
    """An entry here that the code no longer imports would hide a new required one of the same name."""
    assert set(OPTIONAL) <= set(_third_party_imports())


def test_no_requirement_needs_no_deps():
    project = _project()
    groups = {"dependencies": project["dependencies"], **project.get("optional-dependencies", {})}
    for group, reqs in groups.items():
        assert not _names(reqs) & NO_DEPS_ONLY, f"{group} pins a wheel that must be installed with --no-deps"


def test_installed_extras_accept_the_lowest_declared_torch():
    """Each extra requirement installed here must accept the oldest torch the package declares."""
    (torch_req,) = [requirements.Requirement(r) for r in _project()["dependencies"] if r.startswith("torch")]
    (lowest,) = [s.version for s in torch_req.specifier if s.operator == ">="]
    checked = 0
    for group, reqs in _project().get("optional-dependencies", {}).items():
        for r in map(requirements.Requirement, reqs):
            try:
                needs = metadata.requires(r.name) or []
            except metadata.PackageNotFoundError:
                continue
            checked += 1
            for n in map(requirements.Requirement, needs):
                if n.name.lower() == "torch" and (n.marker is None or n.marker.evaluate({"extra": ""})):
                    assert n.specifier.contains(lowest, prereleases=True), f"{group}: {r.name} needs {n}"
    assert checked, "no extra requirement is installed: nothing was checked"
