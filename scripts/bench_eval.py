"""Evaluation speed, batching exact vs packed (multiple choice, perplexity, in the training loop): see `python scripts/bench_eval.py --help` or olmo_ds/tools/bench_eval.py."""

import sys

from olmo_ds.tools.bench_eval import main

if __name__ == "__main__":
    sys.exit(main())
