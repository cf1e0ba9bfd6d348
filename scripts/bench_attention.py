"""Forward+backward TFLOP/s of each attention backend on one GPU: see `python scripts/bench_attention.py --help`
or olmo_ds/tools/bench_attention.py."""

import sys

from olmo_ds.tools.bench_attention import main

if __name__ == "__main__":
    sys.exit(main())
