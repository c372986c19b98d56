"""``python -m splitserve_operator``: run the operator."""

import sys

from splitserve_operator.commands.operator import main

sys.exit(main())
