"""The README's multi-rank example saves what it means to (DEDUP-13)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.spec("DEDUP-13")
def test_readme_multi_rank_example_runs(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    first = next(b for b in blocks if "import refdcp as dcp" in b)
    multi = next(b for b in blocks if "FakeWorld(4).run(rank_main)" in b)
    code = (first + multi).replace('"/tmp/', f'"{tmp_path}/')
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, str(README), "exec"), {})
