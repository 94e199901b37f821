"""The conformance suite against refdcp's storage, torch's storage and the example backend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.backends import refdcp_fs, refdcp_memory, torch_fs, torch_fsspec_memory
from conformance.cli import conformance_command
from conformance.examples.dict_backend import DictBackend
from conformance.registry import CHECKS, Result
from conformance.report import to_json, to_markdown
from conformance.runner import all_checks, failed_musts, levels, run_checks

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.filterwarnings("ignore:Detected an existing checkpoint"),
]


#: the power-loss checks: not applicable to storage that writes no files
POWER = {"CONF-58", "CONF-59", "CONF-60"}


def _statuses(results: list[Result]) -> dict[str, str]:
    return {r.id: r.status for r in results}


@pytest.mark.spec(
    "CONF-1",
    "CONF-2",
    "CONF-3",
    "CONF-4",
    "CONF-5",
    "CONF-6",
    "CONF-7",
    "CONF-8",
    "CONF-9",
    "CONF-10",
    "CONF-11",
    "CONF-12",
    "CONF-13",
    "CONF-14",
    "CONF-15",
    "CONF-16",
    "CONF-17",
    "CONF-18",
    "CONF-19",
    "CONF-20",
    "CONF-21",
    "CONF-22",
    "CONF-23",
    "CONF-24",
    "CONF-25",
    "CONF-26",
    "CONF-27",
    "CONF-28",
    "CONF-29",
    "CONF-30",
    "CONF-43",
    "CONF-46",
    "CONF-47",
    "CONF-48",
    "CONF-49",
)
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(refdcp_fs, marks=pytest.mark.slow),  # long; make test-thorough runs it
        refdcp_memory,
        pytest.param(DictBackend, marks=pytest.mark.slow),
    ],
    ids=lambda f: f.__name__,
)
def test_refdcp_storage_and_example_pass_every_check(make: object) -> None:
    backend = make()  # type: ignore[operator]
    results = run_checks(backend, examples=4)
    assert len(results) == len(all_checks())
    bad = [r for r in results if r.status == "fail"]
    assert not bad, bad
    st = _statuses(results)
    # Only a capability the backend does not declare may be not applicable.
    for r in results:
        if r.status == "n/a" and r.id == "CONF-48" and make is not refdcp_fs:
            assert "not shared between processes" in r.reason, r  # in-memory storage
        elif r.status == "n/a" and r.id in POWER and make is not refdcp_fs:
            assert "not a POSIX file backend" in r.reason, r  # no file to lose power on
        elif r.status == "n/a" and r.id == "CONF-67":
            assert "not an AsyncStager" in r.reason, r  # torch's stager stages for them
        elif r.status == "n/a":
            assert r.reason.startswith("backend does not declare"), r
    assert st["CONF-29"] == "pass"  # these backends declare atomic_overwrite


@pytest.mark.spec("CONF-25", "CONF-43", "CONF-42")
@pytest.mark.parametrize(
    "make",
    [pytest.param(torch_fs, marks=pytest.mark.slow), torch_fsspec_memory],
    ids=lambda f: f.__name__,
)
def test_torch_storage_meets_every_must_but_not_atomic_overwrite(make: object) -> None:
    backend = make()  # type: ignore[operator]
    results = run_checks(backend, examples=3)
    # torch_fs saves with sync_files=False: a power loss may lose data under a committed
    # .metadata (CONF-58), and no save is durable (CONF-60); reported, not hidden
    allowed = POWER - {"CONF-59"} if make is torch_fs else set()
    assert {r.id for r in failed_musts(results)} <= allowed, failed_musts(results)
    st = _statuses(results)
    assert st["CONF-25"] == "fail"  # torch overwrites data files in place
    assert st["CONF-29"] == "n/a"


@pytest.mark.spec("CONF-40")
def test_every_check_cites_one_known_conf_requirement() -> None:
    known = levels()
    checks = all_checks()
    assert checks is not CHECKS and len(checks) == len(CHECKS)
    # requirements on the suite itself (CONF-57: when CONF-48 applies)
    suite = (
        set(range(40, 46)) | set(range(50, 58)) | {68, 69}
    )  # CONF-68: the reasons' words; CONF-69: profiles
    assert {c.id for c in checks} == {rid for rid in known if int(rid.split("-")[1]) not in suite}
    assert all(c.id in known for c in checks)


@pytest.mark.spec("CONF-41", "CONF-42")
def test_cli_writes_json_and_markdown_and_exit_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    rc = conformance_command(
        "conformance.examples.dict_backend:backend", json_path=str(out), markdown=True, examples=2
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["ok"] is True and doc["backend"] == "example DictBackend"
    assert {r["id"] for r in doc["results"]} == {c.id for c in all_checks()}
    # CONF-48 needs storage shared between processes; the example keeps a dict in memory.
    # nor do the power-loss checks apply: it writes no files (CONF-58..60)
    # CONF-64 needs storage a pickled writer can share; CONF-67 needs a writer that stages
    no_process = {"CONF-48", "CONF-64", "CONF-67"}
    assert all(r["status"] == "pass" for r in doc["results"] if r["id"] not in POWER | no_process)
    text = capsys.readouterr().out
    assert "| CONF-10 | MUST | pass |" in text
    assert "conforms" in text


@pytest.mark.spec("CONF-41", "CONF-42")
def test_reports_mark_failures_and_warnings() -> None:
    results = [
        Result("CONF-8", "MUST", "t", "fail", "CONF-8: lost an item", 0.0),
        Result("CONF-25", "SHOULD", "t", "fail", "CONF-25: overwritten", 0.0),
        Result("CONF-18", "MUST", "t", "n/a", "backend does not declare concurrent_readers", 0.0),
    ]
    doc = to_json("x", results)
    assert doc["ok"] is False and doc["summary"] == {"pass": 0, "fail": 2, "n/a": 1}
    md = to_markdown("x", results)
    assert "| CONF-8 | MUST | **FAIL** |" in md
    assert "| CONF-25 | SHOULD | fail (warning) |" in md
    assert "does not conform" in md
    assert [r.id for r in failed_musts(results)] == ["CONF-8"]
    assert not failed_musts(results[1:])


@pytest.mark.spec("CONF-42")
def test_cli_exits_nonzero_on_a_failed_must(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import conformance.cli as cli

    bad = [Result("CONF-8", "MUST", "t", "fail", "CONF-8: lost", 0.0)]
    monkeypatch.setattr(cli, "run_checks", lambda backend, **kwargs: bad)
    assert (
        conformance_command(
            "conformance.examples.dict_backend:backend", json_path=None, markdown=False
        )
        == 1
    )
    assert "1 failed MUST" in capsys.readouterr().out


@pytest.mark.spec("CONF-45")
def test_shipped_levels_equal_the_spec_and_are_used_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import json

    from conformance import runner

    shipped = json.loads(runner.LEVELS_FILE.read_text(encoding="utf-8"))
    assert shipped == runner.spec_levels(), (
        "conformance/levels.json is stale: regenerate it from spec/conformance.md"
    )
    monkeypatch.setattr(runner, "spec_levels", lambda: None)  # as in an installed wheel
    assert runner.levels() == shipped
    assert shipped["CONF-25"] == "SHOULD" and shipped["CONF-10"] == "MUST"


@pytest.mark.spec("CONF-45")
def test_cli_imports_backends_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    from conformance.cli import conformance_command

    (tmp_path / "my_author_backend.py").write_text(
        "from conformance.examples.dict_backend import DictBackend\nbackend = DictBackend()\n",
        encoding="utf-8",
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    from conformance.cli import load_backend

    assert load_backend("my_author_backend:backend").name
    assert conformance_command("no_such_module_xyz:backend") == 2
    assert "cannot load" in capsys.readouterr().err
