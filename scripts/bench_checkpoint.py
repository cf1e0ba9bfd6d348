"""How long a checkpoint stops training: see `python scripts/bench_checkpoint.py --help` or olmo_ds/tools/bench_checkpoint.py."""

import sys

from olmo_ds.tools.bench_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
