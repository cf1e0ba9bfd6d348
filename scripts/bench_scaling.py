"""ZeRO-3 weak scaling on one host, 1 to 8 GPUs: tokens/s per GPU, MFU and peak memory against one GPU; see
`python scripts/bench_scaling.py --help` or olmo_ds/tools/bench_scaling.py."""

import sys

from olmo_ds.tools.bench_scaling import main

if __name__ == "__main__":
    sys.exit(main())
