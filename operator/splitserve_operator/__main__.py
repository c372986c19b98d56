"""``python -m splitserve_operator``: run the operator."""

import sys

from splitserve_operator.cli import main

sys.exit(main())
