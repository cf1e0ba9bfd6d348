"""Join the part directories of `prepare_data.py --partition I/M` into one shard directory: see `python scripts/merge_shards.py --help` or olmo_ds/cli/merge_shards.py."""

import sys

from olmo_ds.cli.merge_shards import main

if __name__ == "__main__":
    sys.exit(main())
