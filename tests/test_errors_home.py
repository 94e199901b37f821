"""Every exception class of refdcp lives in an errors module and is drawn in errors.py (ERR-6).

The check reads every ``class`` statement of the package (at any depth, inside
functions too) and evaluates its bases in the module's namespace: a class
deriving from ``BaseException`` outside ``refdcp/errors.py``,
``refdcp/errors_core.py`` or a package's ``errors.py`` fails it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import refdcp
import refdcp.errors as errors

ROOT = Path(refdcp.__file__).resolve().parent
HOMES = {"errors.py", "errors_core.py"}
NOT_REFDCP_ERRORS = {
    "CheckpointError",
    "InjectedFault",
    "ModelFault",
    "SpawnError",
    "MetadataLoadError",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _namespace(module: str, tree: ast.Module) -> dict[str, object]:
    """The module's globals plus every name it imports at any depth (function bodies too)."""
    namespace = dict(vars(importlib.import_module(module)))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            source = importlib.import_module(node.module)
            for alias in node.names:
                if hasattr(source, alias.name):
                    namespace.setdefault(alias.asname or alias.name, getattr(source, alias.name))
    return namespace


def exception_classes_in(tree: ast.Module, namespace: dict[str, object]) -> list[tuple[str, type]]:
    """(name, base) of every class statement of ``tree`` whose base is an exception class."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                try:
                    value = eval(compile(ast.Expression(base), "<base>", "eval"), dict(namespace))
                except NameError:  # a base chosen at run time (a local variable): not static
                    continue
                if inspect.isclass(value) and issubclass(value, BaseException):
                    found.append((node.name, value))
                    break
    return found


def _exception_classes() -> list[tuple[str, str, type]]:
    """(module file, class name, class) for every class statement deriving from BaseException."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        namespace = _namespace(_module_name(path), tree)
        for name, base in exception_classes_in(tree, namespace):
            cls = namespace.get(name, base)
            found.append((rel, name, cls if isinstance(cls, type) else base))
    return found


@pytest.mark.spec("ERR-6")
def test_every_exception_class_is_defined_in_an_errors_module() -> None:
    found = _exception_classes()
    assert len(found) >= 30, found  # the walk sees the hierarchy
    stray = sorted(f"{rel}: {name}" for rel, name, _ in found if Path(rel).name not in HOMES)
    assert not stray, f"exception classes outside the errors modules: {stray}"


@pytest.mark.spec("ERR-6")
def test_every_exception_class_is_drawn_and_derives_from_the_base() -> None:
    drawing = " ".join((errors.__doc__ or "").split())
    for rel, name, cls in _exception_classes():
        assert f" {name} " in drawing, f"{rel}: {name} is not drawn in refdcp/errors.py"
        if name not in NOT_REFDCP_ERRORS:
            assert issubclass(cls, errors.RefdcpError), f"{rel}: {name}"
        else:
            assert not issubclass(cls, errors.RefdcpError), f"{name}: update ERR-6's exceptions"


@pytest.mark.spec("ERR-6")
def test_the_walk_finds_a_class_hidden_in_a_function_body() -> None:
    """The walker's own check: an exception class inside a function, on an imported base."""
    tree = ast.parse(
        "from refdcp.errors import RefdcpError\n"
        "def f():\n    class Hidden(RefdcpError):\n        pass\n    class Plain:\n        pass\n"
    )
    found = exception_classes_in(tree, _namespace("refdcp.errors", tree))
    assert [name for name, _ in found] == ["Hidden"]


@pytest.mark.spec("ERR-6")
@pytest.mark.parametrize(
    ("package", "module"),
    [("refdcp.planning", "refdcp.planning.errors"), ("refdcp.storage", "refdcp.storage.errors")],
)
def test_package_errors_are_re_exported_by_the_package(package: str, module: str) -> None:
    pkg, mod = importlib.import_module(package), importlib.import_module(module)
    public = [n for n in mod.__all__ if n != "MetadataFieldMissing"]  # internal to the bulk check
    assert public and all(getattr(pkg, n) is getattr(mod, n) for n in public)
