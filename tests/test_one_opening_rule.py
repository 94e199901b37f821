"""Every file refdcp opens in a checkpoint directory goes through one rule (STORE-59).

The structural test walks the syntax tree of every module of the package and finds
each call that opens a file (``os.open``, ``open``, ``Path.open``/``read_*``/``write_*``,
``tempfile``, ``torch.load`` of a path, torch's zip writer). Each must be the rule
itself (``refdcp/storage/fs/paths.py``), an ``open`` of a descriptor the rule just
returned, or be listed below with the reason it is not a file of a checkpoint
directory. A new ``open`` anywhere else fails the test, and so does a listed reason
whose call is gone. The behavioural tests then show what the rule refuses.
"""

from __future__ import annotations

import ast
import os
import socket
import threading
from pathlib import Path

import pytest

import refdcp
from refdcp.storage.errors import UnsafePathError
from refdcp.storage.fs.metadata_file import read_metadata_file
from refdcp.storage.fs.paths import open_regular, opened_dir

PACKAGE = Path(refdcp.__file__).resolve().parent

#: the functions that ARE the rule
RULE = {
    "storage/fs/paths.py:open_regular:os.open",
    "storage/fs/paths.py:opened_dir:os.open",
}

#: callables whose result is a descriptor opened by the rule
RULE_OPENERS = {"open_regular", "open_data_file", "_open_named", "opened_dir"}

#: every other opening call in the package, with the reason it is not a file of a
#: checkpoint directory
ALLOWED = {
    "crc/pieces.py:_running:open": "reads /proc/loadavg, a kernel file",
    "storage/fs/paths.py:boot_id:open": "reads /proc/sys/kernel/random/boot_id, a kernel file",
    "storage/fs/mounts.py:mount_table:read_text": "reads /proc/self/mountinfo, a kernel file",
    "reference/storage.py:ReferenceWriter.write_data:os.open": (
        "the reference states the rule in its own words (REF-1): O_CREAT|O_EXCL of a new "
        "name never follows a link; test_the_reference_reader_refuses_what_the_rule_refuses"
    ),
    "reference/storage.py:ReferenceWriter.write_data:open": "wraps the descriptor above",
    "reference/storage.py:ReferenceWriter.finish:os.open": "the reference's temp .metadata, O_CREAT|O_EXCL",
    "reference/storage.py:ReferenceWriter.finish:open": "wraps the descriptor above",
    "reference/storage.py:_fsync_dir:os.open": "the reference opens its directory to fsync it",
    "reference/storage.py:ReferenceReader._open:os.open": (
        "the reference's reader: O_NOFOLLOW|O_NONBLOCK and a regular-file check, the rule "
        "in its own words (checked below)"
    ),
    "reference/storage.py:ReferenceReader._open:open": "wraps the descriptor above",
    "tools/convert.py:_TorchSaveSource.__init__:torch.load": (
        "torch maps the user's torch.save file itself, after _open_named refused a FIFO"
    ),
    "tools/convert.py:_write_torch_save:PyTorchFileWriter": (
        "torch's zip writer, given the file object of a new file convert created (STORE-63)"
    ),
    "tools/convert.py:*:tempfile.mkstemp": (
        "a new file of a convert destination (a shard, an index, a torch.save or safetensors "
        "file renamed into place): O_CREAT|O_EXCL under a random name"
    ),
    "tools/convert.py:_new_file:open": (
        "wraps mkstemp's descriptor: a new file convert writes through it, never reopening "
        "it by name (STORE-63)"
    ),
    "tools/diagrams.py:main:write_text": "the repository's spec/diagrams.md",
    "tools/diagrams.py:main:read_text": "the repository's spec/staging.md",
    "tools/diagrams.py:main:write_text#2": "the repository's spec/staging.md",
    "tools/learner_path.py:code_lines:read_text": "refdcp's own source files, to count lines",
    "tools/spec_report.py:*:read_text": "the repository's spec/ and tests/ sources",
    "tools/prose_check.py:*:read_text": "the repository's README, docs/ and spec/",
    "tools/life_of_a_save.py:*:read_text": "the repository's docs/life-of-a-save.md",
    "tools/life_of_a_save.py:*:write_text": "the repository's docs/life-of-a-save.md",
    "tools/differences.py:*:read_text": "the repository's spec/ and README.md",
    "tools/differences.py:*:write_text": "the repository's README.md",
}

_OPEN_ATTRS = {"open", "fdopen", "read_bytes", "read_text", "write_bytes", "write_text"}
_OTHER = {"mkstemp", "NamedTemporaryFile", "TemporaryFile", "PyTorchFileWriter", "safe_open"}


def _call_name(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Name) and f.id in {"open", *_OTHER}:
        return f.id
    if isinstance(f, ast.Attribute):
        base = f.value.id if isinstance(f.value, ast.Name) else None
        if f.attr in _OPEN_ATTRS:
            return f"{base}.{f.attr}" if base in {"os", "io"} else f.attr
        if f.attr in _OTHER:
            return f"{base}.{f.attr}" if base == "tempfile" else f.attr
        if f.attr == "load" and base == "torch" and call.args and _path_like(call.args[0]):
            return "torch.load"
    return None


def _path_like(node: ast.expr) -> bool:
    """A path rather than an open stream: a string, ``a / b``, or a name or attribute
    that says path or file (streams here are ``BytesIO``s, ``FileSlice``s, ``value``)."""
    if isinstance(node, (ast.Constant, ast.BinOp)):
        return True
    name = (
        node.id
        if isinstance(node, ast.Name)
        else node.attr
        if isinstance(node, ast.Attribute)
        else ""
    )
    return name in {"p", "dst", "src"} or "path" in name or "file" in name


def _from_rule(node: ast.expr, rule_names: set[str]) -> bool:
    if isinstance(node, ast.Call):
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        return name in RULE_OPENERS
    return isinstance(node, ast.Name) and node.id in rule_names


class _Finder(ast.NodeVisitor):
    def __init__(self, module: str) -> None:
        self.module = module
        self.scope: list[str] = []
        self.found: list[tuple[str, int]] = []

    def _visit_scope(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        if not isinstance(node, ast.ClassDef):
            self._check_function(node)
        else:
            self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _visit_scope

    def _check_function(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        rule_names: set[str] = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and _from_rule(node.value, set()):
                rule_names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        seen: dict[str, int] = {}
        for node in ast.walk(fn):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node is not fn:
                continue
            if not isinstance(node, ast.Call):
                continue
            name = _call_name(node)
            if name is None:
                continue
            if name in {"open", "os.fdopen"} and node.args and _from_rule(node.args[0], rule_names):
                continue
            seen[name] = seen.get(name, 0) + 1
            suffix = f"#{seen[name]}" if seen[name] > 1 else ""
            self.found.append((f"{self.module}:{'.'.join(self.scope)}:{name}{suffix}", node.lineno))
        for child in ast.iter_child_nodes(fn):
            self.visit(child)

    def visit_Call(self, node: ast.Call) -> None:  # module-level calls
        name = _call_name(node)
        if name is not None and not self.scope:
            self.found.append((f"{self.module}:<module>:{name}", node.lineno))
        self.generic_visit(node)


def opening_calls() -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        finder = _Finder(module)
        finder.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        out += finder.found
    return out


def _listed(key: str) -> str | None:
    if key in RULE or key in ALLOWED:
        return key
    module, _, rest = key.partition(":")
    wild = f"{module}:*:{rest.split(':', 1)[1].split('#')[0]}"
    return wild if wild in ALLOWED else None


@pytest.mark.spec("STORE-59")
def test_every_open_in_the_package_is_the_rule_or_listed_with_its_reason() -> None:
    calls = opening_calls()
    unlisted = [f"refdcp/{key} (line {line})" for key, line in calls if _listed(key) is None]
    assert not unlisted, (
        "files opened outside refdcp.storage.fs.paths.open_regular, with no reason listed "
        f"in {__file__}: {unlisted}"
    )
    used = {_listed(key) for key, _ in calls}
    stale = sorted((set(ALLOWED) | RULE) - used)
    assert not stale, f"listed opening calls that no longer exist: {stale}"


@pytest.mark.spec("STORE-59")
def test_the_finder_sees_a_planted_open(tmp_path: Path) -> None:
    """The structural test can fail: a plain ``open`` of a checkpoint file is found."""
    tree = ast.parse(
        "def read(root, name):\n"
        "    with open(root / name, 'rb') as f:\n"
        "        return f.read()\n"
        "def ok(root, name):\n"
        "    fd = open_regular(root / name, 0)\n"
        "    return open(fd, 'rb')\n"
        "def raw(p):\n"
        "    return os.open(p, 0), p.read_bytes(), torch.load(path)\n"
    )
    finder = _Finder("storage/fs/planted.py")
    finder.visit(tree)
    keys = [k for k, _ in finder.found]
    assert keys == [
        "storage/fs/planted.py:read:open",
        "storage/fs/planted.py:raw:os.open",
        "storage/fs/planted.py:raw:read_bytes",
        "storage/fs/planted.py:raw:torch.load",
    ]
    assert all(_listed(k) is None for k in keys)


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


@pytest.mark.spec("STORE-59")
@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory", "socket", "device"])
@pytest.mark.parametrize("flags", [os.O_RDONLY, os.O_RDWR | os.O_CREAT])
def test_the_rule_refuses_links_fifos_directories_sockets_devices_without_blocking(
    tmp_path: Path, kind: str, flags: int
) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"outside")
    path = tmp_path / "x"
    held: list[socket.socket] = []
    if kind == "symlink":
        path.symlink_to(target)
    elif kind == "fifo":
        _fifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        held.append(s)
    else:
        path.symlink_to("/dev/null")
    done: list[BaseException] = []

    def attempt() -> None:
        try:
            open_regular(path, flags)
        except BaseException as exc:
            done.append(exc)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(10)
    for s in held:
        s.close()
    assert done, f"open_regular blocked on a {kind}"
    assert isinstance(done[0], UnsafePathError), done[0]
    assert target.read_bytes() == b"outside"
    # the descriptor-relative form refuses a name that leaves the directory
    dfd = opened_dir(tmp_path)
    try:
        for bad in ("../x", "a/b", "..", ""):
            with pytest.raises(UnsafePathError):
                open_regular(bad, os.O_RDONLY, dir_fd=dfd)
    finally:
        os.close(dfd)


@pytest.mark.spec("STORE-59")
def test_metadata_behind_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere"
    real.write_bytes(b"x" * 10)
    (tmp_path / ".metadata").symlink_to(real)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        read_metadata_file(tmp_path / ".metadata")
