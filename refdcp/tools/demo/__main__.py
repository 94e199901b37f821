"""``python -m refdcp.tools.demo``: ``refdcp demo`` with the same arguments (TOOL-24).

The entry lives here, not in the package, because it goes through the ``refdcp``
command line (``tools/cli.py``), which imports the demo: the demo itself never
imports the command line.
"""

from __future__ import annotations

import sys

from refdcp.tools.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) as ``refdcp demo``'s arguments and run it."""
    return cli_main(["demo", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
