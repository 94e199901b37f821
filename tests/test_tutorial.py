"""docs/tutorial.md runs as written (spec/tooling.md, TUT-1..TUT-3)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import traceback
from pathlib import Path
from typing import Any

import pytest

from refdcp.tools.spec_report import load_spec, repo_root

TUTORIAL = repo_root() / "docs" / "tutorial.md"

#: The sections TUT-2 requires, in order.
SECTIONS = (
    "## 1. A first save and load",
    "## 2. Planning: local plans and the global plan",
    "## 3. Dedup: replicated tensors are written once",
    "## 4. Commit: all or nothing",
    "## 5. Resharding: save at 4 ranks, load at 2",
    "## 6. Async staging",
    "## 7. DTensors on a real process group",
)

_BLOCK = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
_SPEC_ID = re.compile(r"\b([A-Z][A-Z0-9]*-\d+)\b")


def _text() -> str:
    return TUTORIAL.read_text(encoding="utf-8")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """Every ```python block of ``text`` in order, with the line its code starts on."""
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _BLOCK.finditer(text)]


def _sections(text: str) -> dict[str, str]:
    """Each required heading mapped to the text up to the next ``## `` heading."""
    out: dict[str, str] = {}
    for heading in SECTIONS:
        start = text.index(heading + "\n")
        nxt = text.find("\n## ", start + len(heading))
        out[heading] = text[start : len(text) if nxt < 0 else nxt]
    return out


@pytest.mark.spec("TUT-1", "TUT-4")
def test_tutorial_blocks_run_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = python_blocks(_text())
    assert len(blocks) >= 6
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "tutorial"}
    out = io.StringIO()
    try:
        for n, (line, code) in enumerate(blocks, 1):
            compiled = compile(code, f"{TUTORIAL}:block{n}@line{line}", "exec")
            try:
                with contextlib.redirect_stdout(out):
                    exec(compiled, namespace)
            except Exception as exc:  # reported with the block and the output so far
                pytest.fail(
                    f"docs/tutorial.md block {n} (line {line}) raised "
                    f"{type(exc).__name__}: {exc}\n"
                    f"--- stdout so far ---\n{out.getvalue()[-4000:]}\n"
                    f"--- traceback ---\n{traceback.format_exc()}"
                )
        assert out.getvalue(), "the tutorial printed nothing"
        # temporary directories only, removed at the end; nothing in the working directory
        root = namespace.get("root")
        assert isinstance(root, str) and not os.path.exists(root)
        assert list(tmp_path.iterdir()) == []
    finally:
        leftover = namespace.get("root")
        if isinstance(leftover, str):
            shutil.rmtree(leftover, ignore_errors=True)


@pytest.mark.spec("TUT-2")
def test_tutorial_has_every_section_with_asserting_code() -> None:
    text = _text()
    assert len(python_blocks(text)) >= 6
    positions = []
    for heading in SECTIONS:
        assert re.search(rf"^{re.escape(heading)}$", text, re.MULTILINE), f"missing {heading!r}"
        positions.append(text.index(heading + "\n"))
    assert positions == sorted(positions), "sections out of order"
    for heading, body in _sections(text).items():
        blocks = [code for _, code in python_blocks(body)]
        assert blocks, f"{heading!r} has no python block"
        assert any(re.search(r"^\s*assert\b", c, re.MULTILINE) for c in blocks), (
            f"{heading!r} asserts nothing"
        )
    code = "\n".join(c for _, c in python_blocks(text))
    assert "FakeWorld(4)" in code and "LocalShards(" in code
    assert "refdcp.async_save(" in code and "fault=" in code and "FakeWorld(2)" in code


@pytest.mark.spec("TUT-3")
def test_tutorial_cites_only_known_requirements() -> None:
    known, _ = load_spec(repo_root() / "spec")
    cited = set(_SPEC_ID.findall(_text()))
    assert cited, "the tutorial cites no requirement"
    assert not sorted(cited - set(known)), f"unknown spec IDs: {sorted(cited - set(known))}"


@pytest.mark.spec("TUT-4")
def test_dtensor_section_saves_on_a_2d_mesh_and_loads_at_another_world_size() -> None:
    body = _sections(_text())["## 7. DTensors on a real process group"]
    code = "\n".join(c for _, c in python_blocks(body))
    assert 'init_device_mesh("cpu", (2, 2)' in code  # a 2-D mesh ...
    assert "Shard(0)" in code and "Shard(1)" in code and "Replicate()" in code
    worlds = [int(n) for n in re.findall(r"run_gloo\((\d+),", code)]
    assert worlds and worlds[0] == 4 and max(worlds) <= 4  # ... of 4 Gloo processes, at most
    assert any(w != worlds[0] for w in worlds[1:])  # loaded at another world size
    assert "full_tensor()" in code and "no_dist=True" in code
