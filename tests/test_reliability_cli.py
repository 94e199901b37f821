"""CLI robustness (issue 11, item 8; TOOL-12..TOOL-14).

A ``.metadata`` of allowed types but missing fields crashed ``refdcp verify``
and ``refdcp inspect`` with a traceback, and a file that exists but cannot be
read was reported as "missing" or "not committed". Every CLI error is now one
line naming the file and the cause, with the exit status of spec/tooling.md.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import refdcp
from refdcp.storage.metadata.safe import dump_metadata, load_metadata
from refdcp.tools.cli import main

SINGLE_PATH = "the refdcp CLI's error reporting (TOOL-12..14); the saved checkpoint is a fixture"

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _ckpt(root: Path) -> Path:
    path = root / "ckpt"
    refdcp.save({"w": torch.ones(4, 4), "step": 1}, checkpoint_id=path)
    return path


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _rewrite(path: Path, mutate: Callable[[Any], None]) -> None:
    md = load_metadata((path / ".metadata").read_bytes())
    mutate(md)
    (path / ".metadata").write_bytes(dump_metadata(md))


_MISSING: dict[str, tuple[Callable[[Any], None], str]] = {
    "state_dict_metadata": (
        lambda md: md.__dict__.pop("state_dict_metadata"),
        "state_dict_metadata: missing",
    ),
    "chunks": (
        lambda md: md.state_dict_metadata["w"].__dict__.pop("chunks"),
        "state_dict_metadata['w'].chunks: missing",
    ),
    "relative_path": (
        lambda md: next(iter(md.storage_data.values())).__dict__.pop("relative_path"),
        ".relative_path: missing",
    ),
}


@pytest.mark.spec("TOOL-14", "TOOL-12")
@pytest.mark.parametrize("field", sorted(_MISSING))
def test_missing_fields_are_one_line_errors(
    tmp_path: Path, field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _ckpt(tmp_path)
    mutate, message = _MISSING[field]
    _rewrite(path, mutate)
    code, _, err = _run(["inspect", str(path)], capsys)
    assert code == 2
    line = _one_line(err)
    assert line.startswith("refdcp inspect: ") and ".metadata" in line and message in line
    code, out, _ = _run(["verify", str(path)], capsys)
    assert code == 1
    assert out.startswith("CORRUPT") and message in out


@pytest.mark.spec("TOOL-13", "TOOL-12")
def test_a_metadata_that_is_not_a_file_is_not_reported_uncommitted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _ckpt(tmp_path)
    (path / ".metadata").unlink()
    (path / ".metadata").mkdir()
    for command in ("inspect", "verify"):
        code, out, err = _run([command, str(path)], capsys)
        assert code == 2, (command, out, err)
        line = _one_line(err)
        assert ".metadata" in line and "not a regular file" in line
        assert "not committed" not in out + err and "missing" not in out + err


def _deny(monkeypatch: pytest.MonkeyPatch, suffix: str) -> None:
    real = os.open

    def open_denied(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith(suffix):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_denied)


@pytest.mark.spec("TOOL-13", "TOOL-12")
def test_an_unreadable_metadata_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _ckpt(tmp_path)
    _deny(monkeypatch, ".metadata")
    for command in ("inspect", "verify"):
        code, out, err = _run([command, str(path)], capsys)
        assert code == 2, (command, out, err)
        line = _one_line(err)
        assert ".metadata" in line and "Permission denied" in line
        assert "not committed" not in out + err and "missing" not in out + err


@pytest.mark.spec("TOOL-13", "INTEG-8")
def test_an_unreadable_data_file_is_not_reported_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _ckpt(tmp_path)
    _deny(monkeypatch, ".distcp")
    code, out, _ = _run(["verify", str(path)], capsys)
    assert code == 1
    assert "Permission denied" in out and "missing" not in out


@pytest.mark.spec("TOOL-12")
def test_a_path_that_is_no_directory_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for command in ("inspect", "verify"):
        code, _, err = _run([command, str(tmp_path / "nowhere")], capsys)
        assert code == 2
        assert "nowhere" in _one_line(err)


@pytest.mark.spec("TOOL-12")
def test_an_unexpected_error_is_one_line_with_status_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import refdcp.tools.inspect as inspect_mod

    def boom(path: Any) -> Any:
        raise ValueError("unexpected\nfailure")

    monkeypatch.setattr(inspect_mod, "inspect_checkpoint", boom)
    code, _, err = _run(["inspect", str(tmp_path)], capsys)
    assert code == 2
    assert _one_line(err) == f"refdcp inspect: {tmp_path}: ValueError: unexpected failure"


@pytest.mark.spec("TOOL-12", "TOOL-14")
def test_the_real_command_prints_no_traceback(tmp_path: Path) -> None:
    path = _ckpt(tmp_path)
    _rewrite(path, _MISSING["state_dict_metadata"][0])
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [sys.executable, "-m", "refdcp.tools.cli", "inspect", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
