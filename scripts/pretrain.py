"""Pretrain an OLMo model on DeepSpeed: see `python scripts/pretrain.py --help` or olmo_ds/cli/pretrain.py."""

import sys

from olmo_ds.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
