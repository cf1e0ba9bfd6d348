"""Generation speed, olmo-ds against transformers' `generate`: see `python scripts/bench_generate.py --help`
or olmo_ds/tools/bench_generate.py."""

import sys

from olmo_ds.tools.bench_generate import main

if __name__ == "__main__":
    sys.exit(main())
