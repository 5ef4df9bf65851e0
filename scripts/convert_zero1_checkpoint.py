#!/usr/bin/env python3
"""Convert the ZeRO-1 optimizer states of a checkpoint tag, with NxD's converter flags.

    python scripts/convert_zero1_checkpoint.py --input_dir ckpts/step_1200 --output_dir ckpts_dp2/step_1200 \
        --convert_to_sharded --dp_size 2 --num_workers 4
    python scripts/convert_zero1_checkpoint.py --input_dir ckpts/step_1200 --output_dir full/step_1200 --convert_to_full

Also available as ``nxd-ckpt convert-zero1``. See docs/zero1.md.
"""

from __future__ import annotations

import sys

from nxd_ckpt.tools.zero1_cli import main

if __name__ == "__main__":
    sys.exit(main())
