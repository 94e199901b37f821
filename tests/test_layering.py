"""Layering checked on the transitive closure of imports, not just direct ones (PROTO-9, STAGE-20).

``imports_of`` parses a module and every refdcp module it imports (at any
depth, including imports inside functions) and collects every module name
imported on the way. Parent packages are not followed for the root
``refdcp/__init__.py`` (the public API, which imports everything); the
protocol's own package ``__init__`` is.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
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
#: the reference path states the format on its own, in one module; REF-2's differential tests
#: prove the two statements agree
FORMAT_HOMES = {"storage/format/layout.py", "storage/metadata/safe.py", "reference/format.py"}


def test_format_knowledge_has_one_home() -> None:
    """File names, the checksum trailer, the version and the format tag are spelled only in
    storage/format/layout.py and storage/metadata/safe.py (and, for the reference path, in
    reference/format.py); everything else imports them."""
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


# --- The whole package: no import cycle, ARCHITECTURE.md's layers (HARN-20, HARN-21) ----------

ARCHITECTURE = ROOT.parent / "ARCHITECTURE.md"


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_of(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The refdcp module an imported name lives in (``a.b.func`` -> ``a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _import_targets(module: str, path: Path) -> set[str]:
    """The refdcp modules named by this module's import statements, at any depth."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(t for a in node.names if (t := _resolve(a.name)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            for a in node.names:  # from pkg import submodule names the submodule, not pkg
                full = f"{mod}.{a.name}"
                target = full if full in MODULES else _resolve(mod)
                if target:
                    out.add(target)
    return out


def module_graph() -> dict[str, set[str]]:
    """Every refdcp module -> the refdcp modules its import statements name, at any depth.

    ``from pkg import mod`` names ``pkg.mod`` when that is a module, else ``pkg``;
    the parent packages Python runs on the way are not counted (HARN-20).
    """
    return {m: _import_targets(m, p) - {m} for m, p in MODULES.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def layer_of(module: str) -> str:
    """``refdcp`` -> ``__init__``; ``refdcp.api`` -> ``api``; ``refdcp.storage.fs.lock`` -> ``storage``."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _collapse(
    graph: dict[str, set[str]], group: Callable[[str], str | None]
) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        ga = group(a)
        if ga is None:
            continue
        out.setdefault(ga, set())
        out[ga] |= {gb for b in targets if (gb := group(b)) is not None and gb != ga}
    return out


@pytest.mark.spec("HARN-20")
def test_the_cycle_finder_finds_cycles_and_only_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    graph = module_graph()
    assert "refdcp.storage.fs.filesystem" in graph["refdcp.storage"]  # package __init__ edges
    assert "refdcp.planning.dedup.blocks" in graph["refdcp.planning.dedup.classes"]  # in a function


@pytest.mark.spec("HARN-20")
def test_no_module_imports_one_that_imports_it_back() -> None:
    cycle = find_cycle(module_graph())
    assert cycle is None, " -> ".join(cycle or [])


@pytest.mark.spec("HARN-20")
def test_the_package_graph_is_acyclic() -> None:
    cycle = find_cycle(_collapse(module_graph(), layer_of))
    assert cycle is None, " -> ".join(cycle or [])


def _architecture_line(prefix: str) -> str:
    lines = [
        ln for ln in ARCHITECTURE.read_text(encoding="utf-8").splitlines() if ln.startswith(prefix)
    ]
    assert len(lines) == 1, f"ARCHITECTURE.md: expected one line starting {prefix!r}"
    return lines[0][len(prefix) :]


def _layers(prefix: str) -> list[list[str]]:
    return [re.findall(r"`([\w]+)`", step) for step in _architecture_line(prefix).split("→")]


def _check_order(graph: dict[str, set[str]], layers: list[list[str]], where: str) -> None:
    rank = {name: i for i, step in enumerate(layers) for name in step}
    assert set(graph) == set(rank), (
        f"{where}: layers named {sorted(rank)}, code has {sorted(graph)}"
    )
    bad = sorted(
        f"{a} -> {b}" for a, targets in graph.items() for b in targets if rank[b] >= rank[a]
    )
    assert not bad, f"{where}: imports that do not go down: {bad}"


@pytest.mark.spec("HARN-21")
def test_every_layer_imports_only_layers_before_it() -> None:
    layers = _layers("Layers: ")
    assert layers[0] == ["errors_core"] and layers[-1] == ["tools"]
    _check_order(_collapse(module_graph(), layer_of), layers, "ARCHITECTURE.md's layers")


def _storage_part(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["refdcp", "storage"]:
        return None
    if len(parts) > 2 and parts[2] in ("errors", "format", "metadata", "fs"):
        return parts[2]
    return "storage"


@pytest.mark.spec("HARN-21")
def test_storage_inner_layers_import_only_those_before_them() -> None:
    layers = _layers("Inside `storage/`: ")
    layers[-1] = ["storage"]  # "the rest of storage/"
    _check_order(_collapse(module_graph(), _storage_part), layers, "storage's inner layers")


@pytest.mark.spec("HARN-21")
def test_crc_imports_no_other_refdcp_module() -> None:
    graph = module_graph()
    crc = [m for m in graph if m.startswith("refdcp.crc")]
    assert len(crc) == 3
    bad = sorted(f"{m} -> {t}" for m in crc for t in graph[m] if not t.startswith("refdcp.crc"))
    assert not bad, bad


FS_CALLS = {
    "open", "os.open", "os.read", "os.write", "os.pread", "os.preadv", "os.pwrite", "os.pwritev",
    "os.readv", "os.writev", "os.rename", "os.replace", "os.unlink", "os.remove", "os.rmdir",
    "os.mkdir", "os.makedirs", "os.fsync", "os.stat", "os.lstat", "os.fstat", "os.listdir",
    "os.scandir", "os.ftruncate", "os.truncate", "io.open", "shutil.rmtree", "shutil.copyfile",
}  # fmt: skip
FS_METHODS = {"read_bytes", "read_text", "write_bytes", "write_text", "unlink", "mkdir", "rename"}
THREAD_CALLS = ("Thread", "ThreadPoolExecutor", "Process", "Popen")


def effects_of(source: str) -> tuple[bool, bool]:
    """(makes a file-system call, starts a thread or process) in this module's own code."""
    fs = threads = False
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in FS_CALLS or (
                isinstance(node.func, ast.Attribute) and node.func.attr in FS_METHODS
            ):
                fs = True
            if name.rpartition(".")[2] in THREAD_CALLS:
                threads = True
    return fs, threads


def _claimed(prefix: str) -> list[str]:
    return re.findall(r"`([\w/.]+)`", _architecture_line(prefix))


def _check_claim(prefix: str, which: int) -> None:
    claimed = _claimed(prefix)
    actual = {
        m.relative_to(ROOT).as_posix()
        for m in MODULES.values()
        if effects_of(m.read_text(encoding="utf-8"))[which]
    }
    covered = {
        a for a in actual if any(a == c or (c.endswith("/") and a.startswith(c)) for c in claimed)
    }
    assert actual == covered, f"{prefix} ARCHITECTURE.md misses {sorted(actual - covered)}"
    idle = [
        c
        for c in claimed
        if not any(a == c or (c.endswith("/") and a.startswith(c)) for a in actual)
    ]
    assert not idle, f"{prefix} ARCHITECTURE.md names {idle}, which do not"


@pytest.mark.spec("HARN-21")
def test_file_system_calls_are_where_architecture_says() -> None:
    _check_claim("* File-system calls only in: ", 0)


@pytest.mark.spec("HARN-21")
def test_threads_are_started_where_architecture_says() -> None:
    _check_claim("* Threads (or processes) started only in: ", 1)


@pytest.mark.spec("HARN-21")
def test_the_effect_scan_sees_calls_in_function_bodies() -> None:
    src = "import os, threading\ndef f(p):\n    os.pread(3, 1, 0)\n    threading.Thread(target=f).start()\n"
    assert effects_of(src) == (True, True)
    assert effects_of("def f(p):\n    return p.upper()\n") == (False, False)
    assert effects_of("def f(p):\n    return p.read_text()\n") == (True, False)


def tree_modules(text: str) -> set[str]:
    """The module paths a ``refdcp/`` layout tree names (a folder names its ``__init__.py``)."""
    block = text.split("```\nrefdcp/\n", 1)[1].split("```", 1)[0]
    names: set[str] = {"__init__.py"}
    stack: list[tuple[int, str]] = []  # (column of the name, folder path)
    for line in block.splitlines():
        m = re.match(r"^([│├└─\s]*)(\S.*?)(?:\s{2,}.*)?$", line)
        if not m or not re.search("[├└]", m.group(1)):
            continue
        col, head = len(m.group(1)), m.group(2)
        tokens = [t.strip() for t in head.split(",")]
        if not all(re.fullmatch(r"[\w.]+\.py|\w+/", t) for t in tokens):
            continue  # a continued description
        while stack and stack[-1][0] >= col:
            stack.pop()
        base = stack[-1][1] if stack else ""
        for t in tokens:
            if t.endswith("/"):
                names.add(f"{base}{t}__init__.py")
                stack.append((col, f"{base}{t}"))
            else:
                names.add(f"{base}{t}")
    return names


@pytest.mark.spec("HARN-21")
def test_architecture_tree_names_every_module_and_only_modules() -> None:
    named = tree_modules(ARCHITECTURE.read_text(encoding="utf-8"))
    actual = {p.relative_to(ROOT).as_posix() for p in MODULES.values()}
    assert not actual - named, (
        f"modules missing from ARCHITECTURE.md's tree: {sorted(actual - named)}"
    )
    assert not named - actual, (
        f"ARCHITECTURE.md's tree names no such module: {sorted(named - actual)}"
    )


@pytest.mark.spec("HARN-21")
def test_the_tree_reader_follows_nesting() -> None:
    text = "```\nrefdcp/\n├── a.py, b/    two\n│   ├── c.py  in b\n│   │         more text\n│   └── d/\n│       └── e.py\n└── f.py\n```\n"
    assert tree_modules(text) == {
        "__init__.py",
        "a.py",
        "b/__init__.py",
        "b/c.py",
        "b/d/__init__.py",
        "b/d/e.py",
        "f.py",
    }


@pytest.mark.spec("HARN-21")
def test_a_module_planted_out_of_the_tree_is_found() -> None:
    """Dropping one module's line from the real tree makes the check name it."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    line = next(ln for ln in text.splitlines() if "learner_path.py" in ln)
    named = tree_modules(text.replace(line + "\n", ""))
    actual = {p.relative_to(ROOT).as_posix() for p in MODULES.values()}
    assert actual - named == {"tools/learner_path.py"}
