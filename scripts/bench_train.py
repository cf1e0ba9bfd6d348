"""Training throughput, MFU, memory and data wait of the real pretrain step on one device,: see `python scripts/bench_train.py --help` or olmo_ds/tools/bench_train.py."""

import sys

from olmo_ds.tools.bench_train import main

if __name__ == "__main__":
    sys.exit(main())
