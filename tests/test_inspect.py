"""``refdcp inspect`` on torch-written checkpoints (spec/tooling.md, TOOL-1..TOOL-8, TOOL-11).

Golden files live in ``tests/golden/``; regenerate them with
``REFDCP_UPDATE_GOLDEN=1 .venv/bin/pytest tests/test_inspect.py``.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from refdcp.tools.inspect import inspect_checkpoint, inspect_command, load_metadata_safely

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("REFDCP_UPDATE_GOLDEN") == "1"


def sample_state_dict() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "linear.weight": torch.randn(4, 3, generator=g),
            "linear.bias": torch.zeros(4, dtype=torch.bfloat16),
            "embed": torch.arange(10, dtype=torch.int64).reshape(5, 2),
            "empty": torch.zeros(0, 3),
        },
        "step": 7,
        "extra": {"name": "run-1", "mask": torch.tensor([True, False])},
    }


def torch_save(path: Path, **kwargs: Any) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sample_state_dict(), checkpoint_id=path, no_dist=True, **kwargs)
    return path


_TOKEN = re.compile(r"(__\d+_\d+)\.[0-9a-f]{12}\.distcp")


def normalise_text(text: str, ckpt: Path) -> str:
    text = text.replace(str(ckpt), "<CKPT>")
    # refdcp's data file names carry a random per-save token.
    text = _TOKEN.sub(r"\1.<TOKEN>.distcp", text)
    # .metadata embeds the checkpoint path and a uuid: its size is not stable.
    text = re.sub(r"(?m)^(  \.metadata  )\d+$", r"\1<SIZE>", text)
    return re.sub(r"(?m)^(files: \d+ \()\d+( bytes\))$", r"\1<TOTAL>\2", text)


def normalise_json(report: dict[str, Any], ckpt: Path) -> str:
    report = json.loads(json.dumps(report))
    report["path"] = "<CKPT>"
    report["storage_meta"]["checkpoint_id"] = "<CKPT>"
    report["storage_meta"]["save_id"] = "<SAVE_ID>"
    for f in report["files"]:
        if f["name"] == ".metadata":
            f["size"] = "<SIZE>"
    return _TOKEN.sub(r"\1.<TOKEN>.distcp", json.dumps(report, indent=2, sort_keys=True) + "\n")


def check_golden(name: str, actual: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(actual)
    assert actual == path.read_text()


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return torch_save(tmp_path / "ckpt")


@pytest.mark.spec("TOOL-1", "TOOL-2", "TOOL-3", "TOOL-4", "TOOL-6", "TOOL-11")
def test_text_golden(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert inspect_command(str(ckpt), as_json=False) == 0
    check_golden("inspect_torch_single_rank.txt", normalise_text(capsys.readouterr().out, ckpt))


@pytest.mark.spec("TOOL-8", "TOOL-11")
def test_json_golden(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert inspect_command(str(ckpt), as_json=True) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == inspect_checkpoint(str(ckpt))
    check_golden("inspect_torch_single_rank.json", normalise_json(printed, ckpt))


@pytest.mark.spec("TOOL-1", "TOOL-4", "TOOL-6")
def test_report_content(ckpt: Path) -> None:
    report = inspect_checkpoint(ckpt)
    keys = {k["fqn"]: k for k in report["keys"]}
    assert list(keys) == sorted(keys)
    assert keys["model.embed"]["dtype"] == "int64" and keys["model.embed"]["shape"] == [5, 2]
    assert keys["model.empty"]["shape"] == [0, 3]
    assert keys["step"]["kind"] == "bytes"
    assert report["format_version"] == "1.0.0"
    assert report["checksums"] == "absent"


@pytest.mark.spec("TOOL-11")
def test_same_content_same_output(tmp_path: Path) -> None:
    a = torch_save(tmp_path / "a")
    b = torch_save(tmp_path / "b")
    assert normalise_json(inspect_checkpoint(a), a) == normalise_json(inspect_checkpoint(b), b)


@pytest.mark.spec("TOOL-5")
def test_uncommitted_directory(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (ckpt / ".metadata").unlink()
    assert inspect_command(str(ckpt), as_json=False) == 1
    out = capsys.readouterr().out
    assert "committed: NO" in out and "__0_0.distcp" in out
    report = inspect_checkpoint(ckpt)
    assert report["committed"] is False and report["keys"] == []
    assert [f["name"] for f in report["files"]] == ["__0_0.distcp"]


@pytest.mark.spec("TOOL-5")
def test_rank_local_metadata_listed(tmp_path: Path) -> None:
    ckpt = torch_save(tmp_path / "local", use_collectives=False)
    report = inspect_checkpoint(ckpt)
    assert report["committed"] is False
    assert report["rank_local_metadata"] == ["__0.metadata"]


@pytest.mark.spec("TOOL-6")
def test_checksums_in_storage_records_are_found(ckpt: Path) -> None:
    md = load_metadata_safely(ckpt / ".metadata")
    assert md.storage_data is not None
    md.storage_data = {
        idx: {
            "relative_path": info.relative_path,
            "offset": info.offset,
            "length": info.length,
            "crc32c": 1234,
        }
        for idx, info in md.storage_data.items()
    }
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    report = inspect_checkpoint(ckpt)
    assert report["checksums"] == "present"
    assert report["checksum_location"] == "storage_data[*].crc32c"
    assert all(c["file"] == "__0_0.distcp" for k in report["keys"] for c in k["chunks"])


@pytest.mark.spec("TOOL-6")
def test_checksum_manifest_file_is_found(ckpt: Path) -> None:
    (ckpt / "checksums.json").write_text("{}")
    report = inspect_checkpoint(ckpt)
    assert report["checksums"] == "present"
    assert report["checksum_location"] == "file checksums.json"


class _Exploit:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch pwned",))


@pytest.mark.spec("TOOL-7")
def test_crafted_metadata_is_refused(
    ckpt: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ckpt)
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    assert inspect_command(str(ckpt), as_json=False) == 2
    assert "refusing to unpickle" in capsys.readouterr().err
    assert not (ckpt / "pwned").exists()


@pytest.mark.spec("TOOL-8")
def test_missing_path_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert inspect_command(str(tmp_path / "nope"), as_json=True) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err


@pytest.mark.spec("TOOL-8")
def test_cli_wiring(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from refdcp.tools.cli import main

    assert main(["inspect", str(ckpt), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["committed"] is True


@pytest.mark.spec("TOOL-4", "TOOL-6", "TOOL-11")
def test_refdcp_written_checkpoint_golden(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from refdcp.storage.fs.filesystem import FileSystemWriter

    ckpt = tmp_path / "refdcp"
    torch_save(ckpt, storage_writer=FileSystemWriter(ckpt))
    assert inspect_command(str(ckpt), as_json=False) == 0
    check_golden("inspect_refdcp_single_rank.txt", normalise_text(capsys.readouterr().out, ckpt))
    report = inspect_checkpoint(ckpt)
    assert report["checksums"] == "present" and report["metadata_checksum"] is True
    assert report["checksum_location"] == "storage_data[*].refdcp_crc32c"
    assert report["refdcp_format"] == 1


@pytest.mark.spec("TOOL-7", "TOOL-8")
def test_truncated_metadata_exit_status(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(data[: len(data) // 2])
    assert inspect_command(str(ckpt), as_json=True) == 2
    assert "cannot read" in capsys.readouterr().err
