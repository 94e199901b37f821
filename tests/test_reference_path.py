"""The reference path stays small and plain (REF-5, REF-7) and keeps what it promises (REF-8)."""

from __future__ import annotations

import ast
import collections
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch

import refdcp
import refdcp.reference
from refdcp.comm import FakeWorld, SingleRank
from refdcp.tools.learner_path import MAX_CODE_LINES, MAX_MODULES, code_lines, learner_path

SINGLE_PATH = "checks refdcp/reference itself: its size, idioms and differences (REF-5, 7, 8)"

REFERENCE = Path(refdcp.reference.__file__).parent
SPEC_ID = re.compile(r"\b[A-Z]+-\d+\b")


@pytest.mark.spec("REF-5", "REF-19")
def test_the_learner_path_fits_its_budget() -> None:
    path = learner_path("reference")
    assert any(p.parts[0] == "reference" for p in path)  # it measured the reference path
    assert len(path) <= MAX_MODULES, sorted(map(str, path))
    assert sum(path.values()) <= MAX_CODE_LINES, path


@pytest.mark.spec("REF-5")
def test_code_lines_skip_blanks_comments_and_docstrings() -> None:
    source = '"""Doc\n\nmore."""\n\n# c\nx = 1  # c\n\n\ndef f():\n    """d"""\n    return """not\na doc"""\n'
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    try:
        assert code_lines(Path(f.name)) == 4  # x = 1, def, return + its 2nd line
    finally:
        os.unlink(f.name)


def _modules() -> list[Path]:
    return sorted(REFERENCE.glob("*.py"))


#: REF-7's one exception: what async_save.py may use of threading and concurrent.futures.
BACKGROUND_NAMES = {"threading": {"Thread", "Condition", "Lock"}, "concurrent.futures": {"Future"}}


def speed_idioms(source: str, name: str) -> list[str]:
    """What REF-7 forbids in the module ``name`` of refdcp/reference/ with this ``source``."""
    tree = ast.parse(source)
    banned = {"numpy", "threading", "concurrent", "gc"}
    allowed = BACKGROUND_NAMES if name == "async_save.py" else {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in banned and (
                    alias.name not in allowed or alias.asname is not None  # no alias hides a use
                ):
                    found.append(f"{name}:{node.lineno} imports {alias.name}")
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] in banned and module not in allowed:
                found.append(f"{name}:{node.lineno} imports from {module}")
            elif module in allowed:  # from concurrent.futures import Future
                extra = {a.name for a in node.names} - allowed[module]
                found.extend(f"{name}:{node.lineno} imports {module}.{e}" for e in sorted(extra))
        if isinstance(node, ast.Attribute):
            if node.attr == "__new__":
                found.append(f"{name}:{node.lineno} builds a record with __new__")
            base = ast.unparse(node.value)
            if base in allowed and node.attr not in allowed[base]:
                found.append(f"{name}:{node.lineno} uses {base}.{node.attr}")
    return found


@pytest.mark.spec("REF-7")
@pytest.mark.parametrize("module", _modules(), ids=lambda p: p.name)
def test_reference_modules_use_no_speed_idioms(module: Path) -> None:
    assert speed_idioms(module.read_text(encoding="utf-8"), module.name) == []


@pytest.mark.spec("REF-7")
def test_the_speed_idiom_scan_allows_only_async_saves_thread_and_future() -> None:
    background = (
        "import threading\nfrom concurrent.futures import Future\nthreading.Thread(target=f)\n"
    )
    assert speed_idioms(background, "async_save.py") == []
    assert len(speed_idioms(background, "api.py")) == 2  # nowhere else
    pool = (
        "from concurrent.futures import Future, ThreadPoolExecutor\nimport gc\nimport numpy as np\n"
    )
    assert len(speed_idioms(pool, "async_save.py")) == 3
    assert speed_idioms("import threading\nthreading.Barrier(2)\n", "async_save.py") == [
        "async_save.py:2 uses threading.Barrier"
    ]
    assert speed_idioms(
        "import concurrent.futures\nconcurrent.futures.wait(fs)\n", "async_save.py"
    ) == ["async_save.py:2 uses concurrent.futures.wait"]
    assert speed_idioms("import threading as t\n", "async_save.py") == [
        "async_save.py:1 imports threading"
    ]
    assert speed_idioms("x = object.__new__(C)\n", "async_save.py") == [
        "async_save.py:1 builds a record with __new__"
    ]


@pytest.mark.spec("REF-7")
@pytest.mark.parametrize("module", _modules(), ids=lambda p: p.name)
def test_every_public_function_and_class_cites_its_requirements(module: Path) -> None:
    tree = ast.parse(module.read_text(encoding="utf-8"))
    assert SPEC_ID.search(ast.get_docstring(tree) or ""), f"{module.name}: module docstring"
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node) or ""
            assert SPEC_ID.search(doc), f"{module.name}: {node.name} cites no requirement"


@pytest.mark.spec("REF-8", "STORE-5")
def test_reference_saves_keep_old_generations_and_refdcp_reclaims_them() -> None:
    def files(path: str) -> set[str]:
        return {n for n in os.listdir(path) if n.endswith(".distcp")}

    with tempfile.TemporaryDirectory() as path:
        FakeWorld(2).run(
            lambda c: refdcp.reference.save({"w": torch.ones(4)}, checkpoint_id=path, comm=c)
        )
        first = files(path)
        FakeWorld(2).run(
            lambda c: refdcp.reference.save({"w": torch.zeros(4)}, checkpoint_id=path, comm=c)
        )
        assert first < files(path)  # the old generation is still there, beside the new one
        assert not any(n.endswith(".tmp") for n in os.listdir(path))
        sd = {"w": torch.ones(4)}
        refdcp.reference.load(sd, checkpoint_id=path, comm=SingleRank())
        assert torch.equal(sd["w"], torch.zeros(4))  # the newest commit is what loads
        refdcp.save({"w": torch.full((4,), 2.0)}, checkpoint_id=path, comm=SingleRank())
        refdcp.save({"w": torch.full((4,), 3.0)}, checkpoint_id=path, comm=SingleRank())
        assert not first & files(path)  # refdcp's writer reclaimed what no commit references


@pytest.mark.spec("REF-8", "STORE-31")
def test_a_failed_reference_write_removes_what_it_wrote() -> None:
    class Boom:
        """Pickles as an empty OrderedDict once (the refusal check at planning, SAVE-12),
        then fails: the write's own pickle."""

        calls = 0

        def __reduce__(self) -> tuple[object, ...]:
            Boom.calls += 1
            if Boom.calls > 1:
                raise RuntimeError("cannot pickle")
            return (collections.OrderedDict, ())

    with tempfile.TemporaryDirectory() as path:
        with pytest.raises(refdcp.CheckpointError) as info:
            refdcp.reference.save(
                {"w": torch.ones(2), "x": Boom()},
                checkpoint_id=path,
                planner=refdcp.reference.ReferenceSavePlanner(check_replicas=False),
            )
        assert info.value.step == "write"
        assert info.value.committed is False
        assert os.listdir(path) == []
