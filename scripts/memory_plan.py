"""A train config's estimated peak memory per GPU for each sequence-parallel size and activation-checkpointing choice:
see `python scripts/memory_plan.py --help` or olmo_ds/tools/memory_plan.py."""

import sys

from olmo_ds.tools.memory_plan import main

if __name__ == "__main__":
    sys.exit(main())
