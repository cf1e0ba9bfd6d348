"""Data preparation throughput: each tokenizer backend's raw ceiling vs prepare_data.py + validate_shards.py: see `python scripts/bench_prepare.py --help` or olmo_ds/tools/bench_prepare.py."""

import sys

from olmo_ds.tools.bench_prepare import main

if __name__ == "__main__":
    sys.exit(main())
