"""Sequence parallelism's tokens/s per GPU and peak memory at several sizes on one host: see
`python scripts/bench_sequence_parallel.py --help` or olmo_ds/tools/bench_sequence_parallel.py."""

import sys

from olmo_ds.tools.bench_sequence_parallel import main

if __name__ == "__main__":
    sys.exit(main())
