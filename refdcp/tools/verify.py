"""``refdcp verify PATH``: check a checkpoint's checksums (INTEG-7)."""

from __future__ import annotations

import json as json_module
import sys

from refdcp.storage.errors import CheckpointReplacedError
from refdcp.storage.verify import MetadataUnreadableError, verify_checkpoint
from refdcp.tools.inspect import one_line

__all__ = ["verify_command"]


def verify_command(path: str, *, json: bool) -> int:
    """Verify ``path``; print a report (INTEG-7).

    Returns 0 when intact, 1 when damaged or not committed, 2 when it could not
    be checked (the directory or ``.metadata`` cannot be read; one line on
    stderr names the file and the cause, TOOL-12, TOOL-13; or saves kept replacing
    the checkpoint while it was checked, INTEG-14), 3 when no problem
    was found but no item carried a checksum (a torch-written checkpoint):
    nothing was verified.
    """
    try:
        report = verify_checkpoint(path)
    except (MetadataUnreadableError, CheckpointReplacedError, OSError) as exc:
        print(f"refdcp verify: {one_line(str(exc))}", file=sys.stderr)
        return 2
    unverified = report.ok and report.items_checked == 0 and report.items_without_checksum > 0
    if json:
        print(json_module.dumps(report.to_json(), indent=2))
    else:
        status = "UNVERIFIED" if unverified else "OK" if report.ok else "CORRUPT"
        print(
            f"{status}: {path}: {report.items_checked} item(s) verified, "
            f"{report.items_without_checksum} without checksum, {len(report.problems)} problem(s)"
        )
        for p in report.problems:
            where = f"fqn={p.fqn!r} " if p.fqn is not None else ""
            print(
                f"  {where}file={p.file!r} offset={p.offset}: {one_line(p.message)}",
                file=sys.stdout,
            )
    if unverified:
        print("  no item has a checksum (written by torch?): only the layout was checked")
        return 3
    return 0 if report.ok else 1
