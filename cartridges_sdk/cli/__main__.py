"""``python -m cartridges_sdk.cli``: the ``cartridges`` command, as torchrun starts it for each rank of ``--nproc``."""

import sys

from . import main

sys.exit(main())
