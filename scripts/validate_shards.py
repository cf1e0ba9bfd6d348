"""Check a shard directory written by scripts/prepare_data.py; exit 0 when every check holds, 1 otherwise: see `python scripts/validate_shards.py --help` or olmo_ds/cli/validate_shards.py."""

import sys

from olmo_ds.cli.validate_shards import main

if __name__ == "__main__":
    sys.exit(main())
