"""``make demo`` / ``refdcp demo``: the main job on embedded defaults (spec/tooling.md, TOOL-24..26)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from refdcp.tools import demo
from refdcp.tools.demo import __main__ as demo_main
from refdcp.tools.spec_report import repo_root

STEPS = ["save", "load (resharded)", "trace", "verify", "inspect", "conformance"]


def _summary(text: str) -> dict[str, str]:
    tail = text[text.rindex("=== summary ===") :]
    found = re.findall(r"^  (ok    |FAILED) (.+?)\s+\d+\.\d\d s  ", tail, re.MULTILINE)
    return {name: status.strip() for status, name in found}


@pytest.mark.spec("TOOL-24", "TOOL-25")
@pytest.mark.slow  # long; make test-thorough runs it
def test_demo_runs_every_step_in_a_fresh_process_and_leaves_nothing(tmp_path: Path) -> None:
    cwd = tmp_path / "cwd"
    tmp = tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=str(repo_root()))
    proc = subprocess.run(
        [sys.executable, "-m", "refdcp.tools.demo"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert _summary(out) == {name: "ok" for name in STEPS}
    assert "refdcp demo: all steps passed" in out
    # the trace of the 4 -> 3 resharded load, verify's and inspect's reports, the suite's table
    assert "refdcp trace: save at world 4, load at world 3" in out
    assert "all_gather(read_outcome):got_ok" in out
    assert "loaded values equal the saved ones: yes" in out
    assert "CONF-1 " in out and "conforms" in out
    # everything it wrote was under its temporary directory, which it removed
    assert list(cwd.iterdir()) == [] and list(tmp.iterdir()) == []


@pytest.mark.spec("TOOL-25")
def test_a_failing_step_makes_the_demo_fail_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def corrupt(d: demo.Demo) -> str:
        data = sorted(d.checkpoint.glob("__1_*.distcp"))[0]
        raw = bytearray(data.read_bytes())
        raw[-40] ^= 0xFF  # inside the last item's bytes: its checksum no longer matches
        data.write_bytes(bytes(raw))
        return f"flipped a byte of {data.name}"

    steps = [s for s in demo.DEFAULT_STEPS if s[0] != "conformance"]
    at = [name for name, _ in steps].index("verify")
    monkeypatch.setattr(demo, "DEFAULT_STEPS", [*steps[:at], ("corrupt", corrupt), *steps[at:]])
    monkeypatch.setattr(demo.tempfile, "tempdir", str(tmp_path))
    out = io.StringIO()
    assert demo.demo_command(out=out) == 1
    text = out.getvalue()
    summary = _summary(text)
    assert summary["verify"] == "FAILED" and summary["save"] == "ok"
    assert summary["inspect"] == "ok"  # the remaining steps still ran
    assert "1 of 6 step(s) FAILED" in text
    assert list(tmp_path.iterdir()) == []


@pytest.mark.spec("TOOL-26")
def test_readme_first_command_is_make_demo_and_ci_runs_it() -> None:
    root = repo_root()
    readme = (root / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```sh\n(.*?)```", readme, re.DOTALL)
    assert block is not None
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    assert [c for c in commands if c] == ["make demo", "make test"]
    makefile = (root / "Makefile").read_text(encoding="utf-8")
    demo_rule = re.search(r"^demo: (\S+)\n\t(.+)$", makefile, re.MULTILINE)
    assert demo_rule is not None and "refdcp.tools.demo" in demo_rule.group(2)
    # the prerequisite is made by running setup, and setup makes it last
    assert re.search(rf"^{re.escape(demo_rule.group(1))}:\n\t\$\(MAKE\) setup$", makefile, re.M)
    setup = makefile[
        makefile.index("\nsetup:") : makefile.index("\n\n", makefile.index("\nsetup:"))
    ]
    assert setup.rstrip().endswith(f"touch {demo_rule.group(1)}")
    ci = (root / ".ci" / "run").read_text(encoding="utf-8")
    assert "set -euo pipefail" in ci
    makes = re.findall(r"^make (\S+)$", ci, re.MULTILINE)
    assert makes == ["setup", "demo", "test", "typecheck", "lint"]


@pytest.mark.spec("TOOL-23")
@pytest.mark.parametrize("argv", [["--save-world", "0"], ["--load-world", "9"], ["--bogus"]])
def test_demo_arguments_are_checked(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo_main.main(argv)
    assert exc.value.code == 2
    assert "usage: refdcp" in capsys.readouterr().err
