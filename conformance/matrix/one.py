"""Run the suite on one matrix backend with the matrix's packages importable (CONF-56).

``python -m conformance.matrix.one TARGET [cli options]``: as ``conformance.cli``,
after adding ``$REFDCP_MATRIX_SITE`` (where ``make conformance-matrix`` installs
the backends' packages) at the end of ``sys.path``, so they never shadow the
environment's own packages.
"""

from __future__ import annotations

import os
import site
import sys

from conformance.cli import main

if __name__ == "__main__":
    extra = os.environ.get("REFDCP_MATRIX_SITE")
    if extra:
        site.addsitedir(extra)
    sys.exit(main())
