"""One suite over both implementations: no module bypasses ``impl`` without a reason (REF-13).

Every ``tests/test_*.py`` is parsed; a use of ``save``, ``load`` or ``async_save`` of
``refdcp`` or ``refdcp.reference`` (an attribute of the package or of an alias it is
imported under, or a name imported from it) is allowed only in a module that takes
the ``impl`` fixture (REF-6) or declares ``SINGLE_PATH = "<reason>"`` at top level.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SINGLE_PATH = "a static scan of the test modules; it saves and loads nothing"

TESTS = Path(__file__).resolve().parent
ENTRY_POINTS = {"save", "load", "async_save"}
PACKAGES = {"refdcp", "refdcp.reference"}


def _package_aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> package for every import of ``refdcp`` or ``refdcp.reference``."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in PACKAGES:
                    # ``import refdcp.reference`` binds ``refdcp``; ``as R`` binds the submodule
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "refdcp"
        elif isinstance(node, ast.ImportFrom) and node.module == "refdcp" and not node.level:
            for a in node.names:
                if a.name == "reference":
                    aliases[a.asname or a.name] = "refdcp.reference"
    return aliases


def _imported_entry_points(tree: ast.Module) -> dict[str, str]:
    """Local name -> ``package.function`` for ``from refdcp[.reference] import save`` etc."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in PACKAGES and not node.level:
            for a in node.names:
                if a.name in ENTRY_POINTS:
                    names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def entry_point_uses(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, what) for every use of a save/load/async_save of either implementation."""
    aliases = _package_aliases(tree)
    imported = _imported_entry_points(tree)
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ENTRY_POINTS:
            owner = _dotted(node.value)
            if owner is None:
                continue
            head, _, rest = owner.partition(".")
            if head in aliases:
                package = aliases[head] + (f".{rest}" if rest else "")
                if package in PACKAGES:
                    uses.append((node.lineno, f"{package}.{node.attr}"))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in imported:
            uses.append((node.lineno, imported[node.id]))
    return sorted(uses)


def takes_impl(tree: ast.Module) -> bool:
    """Whether any function of the module (a test or a fixture) has a parameter ``impl``."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            if any(a.arg == "impl" for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]):
                return True
    return False


def single_path_reason(tree: ast.Module) -> str | None:
    """The module's top-level ``SINGLE_PATH`` string, if it declares a non-empty one."""
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        named = any(isinstance(t, ast.Name) and t.id == "SINGLE_PATH" for t in targets)
        if named and isinstance(value, ast.Constant) and isinstance(value.value, str):
            return value.value.strip() or None
    return None


def bypasses(source: str) -> list[tuple[int, str]]:
    """The uses that bypass the fixture: none when the module takes ``impl`` or says why not."""
    tree = ast.parse(source)
    if takes_impl(tree) or single_path_reason(tree):
        return []
    return entry_point_uses(tree)


@pytest.mark.spec("REF-13", "REF-6")
def test_every_module_that_saves_or_loads_runs_on_both_or_says_why_not() -> None:
    found = []
    for path in sorted(TESTS.glob("test_*.py")):
        for line, what in bypasses(path.read_text(encoding="utf-8")):
            found.append(f"tests/{path.name}:{line}: {what}")
    modules = sorted({f.split(":")[0] for f in found})
    assert not found, (
        f"{len(modules)} modules use save/load without the impl fixture or a SINGLE_PATH "
        f"reason (REF-13): {modules}\n" + "\n".join(found)
    )


@pytest.mark.spec("REF-13")
@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import refdcp\nrefdcp.save({}, checkpoint_id='x')\n", [(2, "refdcp.save")]),
        ("import refdcp.reference\nrefdcp.reference.load({})\n", [(2, "refdcp.reference.load")]),
        ("import refdcp.reference as R\nR.async_save({})\n", [(2, "refdcp.reference.async_save")]),
        ("import refdcp as r\nf = r.load\n", [(2, "refdcp.load")]),
        ("from refdcp import save as s\n\ndef t():\n    s({})\n", [(4, "refdcp.save")]),
        ("from refdcp.reference import load\nload({})\n", [(2, "refdcp.reference.load")]),
        ("from refdcp import reference as ref\nref.save({})\n", [(2, "refdcp.reference.save")]),
        # torch's DCP, other refdcp functions and unrelated objects are not entry points
        ("import torch.distributed.checkpoint as dcp\ndcp.save({})\n", []),
        ("import refdcp\nrefdcp.storage.load_metadata(b'')\nrefdcp.saved\n", []),
        ("import torch\ntorch.save(1, 'x')\n", []),
        # the fixture or a reason clears the module
        ("import refdcp\ndef test_x(impl):\n    refdcp.save({})\n", []),
        ("import refdcp\nSINGLE_PATH = 'fast internals'\nrefdcp.save({})\n", []),
        ("import refdcp\nSINGLE_PATH = '  '\nrefdcp.save({})\n", [(3, "refdcp.save")]),
        ("import refdcp\ndef f():\n    SINGLE_PATH = 'x'\nrefdcp.load({})\n", [(4, "refdcp.load")]),
    ],
)
def test_the_scan_finds_every_spelling_and_accepts_the_fixture_or_a_reason(
    source: str, expected: list[tuple[int, str]]
) -> None:
    assert bypasses(source) == expected
