"""Regenerate ``conformance/reports/``: JSON + markdown for every ready-made backend (CONF-43).

``python -m conformance.make_reports [--examples N]``
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from conformance.cli import load_backend
from conformance.report import dumps, to_json, to_markdown
from conformance.runner import run_checks

__all__ = ["TARGETS", "main"]

TARGETS = {
    "refdcp_fs": "conformance.backends:refdcp_fs",
    "refdcp_memory": "conformance.backends:refdcp_memory",
    "torch_fs": "conformance.backends:torch_fs",
    "torch_fs_synced": "conformance.backends:torch_fs_synced",
    "torch_fsspec_file": "conformance.backends:torch_fsspec_file",
    "torch_fsspec_memory": "conformance.backends:torch_fsspec_memory",
    "torch_hf": "conformance.backends:torch_hf",
    "example_dict": "conformance.examples.dict_backend:backend",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conformance.make_reports")
    p.add_argument("--examples", type=int, default=25)
    p.add_argument("--out", default=str(Path(__file__).parent / "reports"))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = [
        "# Conformance reports",
        "",
        "| backend | pass | fail | n/a | conforms |",
        "| --- | --- | --- | --- | --- |",
    ]
    sections = []
    for stem, target in TARGETS.items():
        backend = load_backend(target)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = run_checks(backend, examples=a.examples)
        (out / f"{stem}.json").write_text(dumps(backend.name, results), encoding="utf-8")
        md = to_markdown(backend.name, results)
        (out / f"{stem}.md").write_text(md, encoding="utf-8")
        doc = to_json(backend.name, results)
        s = doc["summary"]
        summary.append(
            f"| [{backend.name}]({stem}.md) | {s['pass']} | {s['fail']} | {s['n/a']} | "
            f"{'yes' if doc['ok'] else 'NO'} |"
        )
        sections.append(md)
        print(f"{stem}: {s}", file=sys.stderr)
    # reports made elsewhere keep their row (the matrix's live in matrix/, linked below)
    for extra in sorted(out.glob("*.json")):
        if extra.stem in TARGETS:
            continue
        doc = json.loads(extra.read_text(encoding="utf-8"))
        s = doc["summary"]
        summary.append(
            f"| [{doc['backend']}]({extra.stem}.md) | {s['pass']} | {s['fail']} | {s['n/a']} | "
            f"{'yes' if doc['ok'] else 'NO'} |"
        )
        md_path = extra.with_suffix(".md")
        if md_path.is_file():
            sections.append(md_path.read_text(encoding="utf-8"))
    summary += [
        "",
        "Real third-party backends (s3fs, adlfs, multi-storage-client, s3torchconnector, "
        "torch's HuggingFace storage) against local servers: the compatibility matrix, "
        "[`matrix/README.md`](matrix/README.md) (`make conformance-matrix`).",
    ]
    text = "\n".join(summary) + "\n\n" + "\n".join(sections)
    (out / "README.md").write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
