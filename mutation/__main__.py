"""``python -m mutation``: see mutation/run.py."""

import sys

from mutation.run import main

sys.exit(main())
