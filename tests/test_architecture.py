"""The package's shape: no import cycles (between modules, nor between subpackages), and the
public face `import popbert` promises."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source folder → installed package name (setup.cfg's package_dir).
PACKAGES = {"popbert": "popbert", "builders": "popbert.builders",
            "optimizers": "popbert.optimizers", "data": "popbert.data"}


def _modules() -> dict[str, Path]:
    modules = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if folder == "popbert" and parts[0] in ("builders", "optimizers", "data"):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def import_graph() -> dict[str, set[str]]:
    """Module → popbert modules it imports, at any level (function-level imports count: they
    may hide a cycle from the interpreter, not from the design), TYPE_CHECKING blocks aside."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_lines(tree)
        edges: set[str] = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            found: set[str] = set()
            if isinstance(node, ast.Import):
                found = {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import submodule` → the submodule; `from mod import name` → mod.
                found = {f"{node.module}.{a.name}" for a in node.names
                         if f"{node.module}.{a.name}" in modules}
                if not found and node.module in modules:
                    found = {node.module}
            edges.update(found - {name})
        graph[name] = edges
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for child in sorted(graph.get(node, ())):
            if state.get(child) == 1:
                return stack[stack.index(child):] + [child]
            if child not in state:
                found = visit(child)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def test_the_modules_import_each_other_without_a_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 60
    assert _find_cycle(graph) is None, " → ".join(_find_cycle(graph) or [])


def test_the_subpackages_import_each_other_without_a_cycle() -> None:
    """The folders are layers: config → graph → lowering → runtime → train, never back."""
    packages: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        if module == "popbert":
            continue
        edges = packages.setdefault(_subpackage(module), set())
        edges.update(_subpackage(t) for t in targets if _subpackage(t) != _subpackage(module))
    cycle = _find_cycle(packages)
    assert cycle is None, " → ".join(cycle or [])


def test_the_cycle_finder_finds_cycles() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("name", ["Builder", "TensorInfo", "TrainingSession", "InferenceSession",
                                  "SessionOptions", "load_config", "build_bert"])
def test_the_public_face(name: str) -> None:
    import popbert

    assert name in popbert.__all__
    assert getattr(popbert, name) is not None


def test_import_popbert_stays_light() -> None:
    """`import popbert` (and the CLI's error paths) must not pay for torch."""
    code = "import sys, popbert; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"


def test_an_unknown_public_name_is_an_attribute_error() -> None:
    import popbert

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        popbert.Nope  # noqa: B018
