"""Data loader throughput per rank (tokens/s, instances/s) and its wait share of a simulated GPU step: see `python scripts/bench_data.py --help` or olmo_ds/tools/bench_data.py."""

import sys

from olmo_ds.tools.bench_data import main

if __name__ == "__main__":
    sys.exit(main())
