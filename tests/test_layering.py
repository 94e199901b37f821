"""Layering checked on the transitive closure of imports, not just direct ones (PROTO-9, STAGE-20).

``imports_of`` parses a module and every refdcp module it imports (at any
depth, including imports inside functions) and collects every module name
imported on the way. Parent packages are not followed for the root
``refdcp/__init__.py`` (the public API, which imports everything); the
protocol's own package ``__init__`` is.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import refdcp

ROOT = Path(refdcp.__file__).resolve().parent


def _file_of(module: str) -> Path | None:
    rel = module.split(".")[1:]
    base = ROOT.joinpath(*rel)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports_in(module: str, path: Path) -> tuple[set[str], bool]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    calls_open = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            names.add(mod)
            names.update(f"{mod}.{a.name}" for a in node.names)  # from pkg import submodule
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "open":
            calls_open = True
    return names, calls_open


def imports_of(start: str) -> tuple[set[str], set[str], set[str]]:
    """(refdcp modules reached, every module name imported, refdcp modules that call open)."""
    seen: set[str] = set()
    imported: set[str] = set()
    opens: set[str] = set()
    todo = [start]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        path = _file_of(module)
        if path is None:
            continue
        seen.add(module)
        names, calls_open = _imports_in(module, path)
        if calls_open:
            opens.add(module)
        imported |= names
        todo.extend(n for n in names if n.startswith("refdcp.") and n not in seen)
    return seen, imported, opens


BANNED_IN_PROTOCOL = {
    "torch",
    "time",
    "io",
    "os",
    "pathlib",
    "socket",
    "threading",
    "subprocess",
    "multiprocessing",
    "shutil",
    "tempfile",
    "asyncio",
    "concurrent",
    "random",
}


@pytest.mark.spec("PROTO-9")
def test_protocol_closure_imports_no_torch_no_io_no_clock() -> None:
    reached, imported, opens = imports_of("refdcp.protocol")
    assert {"refdcp.protocol.machine", "refdcp.protocol.save", "refdcp.errors_core"} <= reached
    assert "refdcp.errors" not in reached  # errors.py imports torch for CheckpointError
    bad = sorted(n for n in imported if n.split(".")[0] in BANNED_IN_PROTOCOL)
    assert not bad, f"the protocol reaches {bad} through {sorted(reached)}"
    assert not opens, f"{sorted(opens)} call open()"


@pytest.mark.spec("PROTO-9")
def test_the_closure_walk_sees_what_a_direct_check_would_miss() -> None:
    """The walker follows refdcp imports: driver/run.py imports no torch itself, but reaches it via errors.py."""
    reached, imported, _ = imports_of("refdcp.driver.run")
    assert "refdcp.errors" in reached and "torch.distributed.checkpoint.api" in imported


@pytest.mark.spec("PROTO-9")
def test_importing_the_protocol_loads_no_torch() -> None:
    """At run time: the protocol package imported on its own (without refdcp's API) loads no torch."""
    code = textwrap.dedent(
        f"""
        import sys, types
        pkg = types.ModuleType("refdcp")
        pkg.__path__ = [{str(ROOT)!r}]
        sys.modules["refdcp"] = pkg
        import refdcp.protocol
        from refdcp.protocol import SAVE
        SAVE.start(0, True)
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy")))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


ABOVE_STAGING = ("refdcp.asyncsave", "refdcp.api", "refdcp.tools", "refdcp.driver", "refdcp.comm")


@pytest.mark.spec("STAGE-20")
def test_staging_imports_nothing_above_it() -> None:
    reached, imported, _ = imports_of("refdcp.staging")
    assert "refdcp.staging.cpu_stager" in reached
    bad = sorted(n for n in imported | reached if n.startswith(ABOVE_STAGING))
    assert not bad, f"staging reaches {bad}"


FORMAT_LITERALS = (
    ".metadata",
    "#refdcp-crc32c",
    "1.0.0",
    ".distcp",
)  # "refdcp_format" is also a report key
FORMAT_HOMES = {"storage/format/layout.py", "storage/metadata/safe.py"}


def test_format_knowledge_has_one_home() -> None:
    """File names, the checksum trailer, the version and the format tag are spelled only in
    storage/format/layout.py and storage/metadata/safe.py; everything else imports them."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in FORMAT_HOMES:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and id(node) not in docstrings:
                value = node.value
                text = value.decode("latin-1") if isinstance(value, bytes) else value
                if isinstance(text, str) and any(
                    lit == text or text.startswith(lit) for lit in FORMAT_LITERALS
                ):
                    offenders.append(f"{rel}:{node.lineno}: {text!r}")
    assert not offenders, "\n".join(offenders)
