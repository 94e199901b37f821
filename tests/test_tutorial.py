"""docs/tutorial.md runs as written, as one script file (spec/tooling.md, TUT-1..TUT-5)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

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
    "## 8. The reference: the same save and load, written to be read",
    "## 9. Model-checking the protocol",
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


def tutorial_script(text: str) -> str:
    """The tutorial's python blocks as one script, each headed by the line it starts on."""
    return "\n\n".join(
        f"# ---- {TUTORIAL.name} line {line} ----\n{code}" for line, code in python_blocks(text)
    )


@pytest.mark.spec("TUT-1", "TUT-4", "TUT-5")
def test_tutorial_runs_as_one_script_file(tmp_path: Path) -> None:
    """As a reader runs it: the blocks saved to a file, run by ``python file`` in a subprocess."""
    blocks = python_blocks(_text())
    assert len(blocks) >= 6
    script = tmp_path / "tutorial.py"
    script.write_text(tutorial_script(_text()), encoding="utf-8")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(repo_root()), *filter(None, [env.get("PYTHONPATH")])])
    before = set(tempfile_root().iterdir())
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, (
        f"the tutorial script failed (its lines are headed by the tutorial's):\n"
        f"--- stdout ---\n{done.stdout[-4000:]}\n--- stderr ---\n{done.stderr[-8000:]}"
    )
    assert done.stdout, "the tutorial printed nothing"
    # temporary directories only, removed at the end; nothing in the working directory
    assert [p.name for p in tmp_path.iterdir()] == ["tutorial.py"]
    left = [p for p in set(tempfile_root().iterdir()) - before if "refdcp-tutorial-" in p.name]
    assert left == [], left


def tempfile_root() -> Path:
    return Path(tempfile.gettempdir())


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


@pytest.mark.spec("TUT-2")
def test_the_reference_section_saves_at_4_loads_at_3_and_reads_the_files() -> None:
    body = _sections(_text())["## 8. The reference: the same save and load, written to be read"]
    code = "\n".join(c for _, c in python_blocks(body))
    assert "refdcp.reference.save(" in code and "refdcp.reference.load(" in code
    assert "FakeWorld(4).run(reference_save)" in code and "FakeWorld(3).run(reference_load)" in code
    # the files themselves: each item's bytes read at its offset and loaded with torch.load
    assert "f.seek(info.offset)" in code and "torch.load(io.BytesIO(blob)" in code


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
