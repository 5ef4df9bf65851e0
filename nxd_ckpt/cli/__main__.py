"""``python -m nxd_ckpt.cli``: the ``nxd-ckpt`` command."""

import sys

from nxd_ckpt.cli.entry import main

sys.exit(main())
