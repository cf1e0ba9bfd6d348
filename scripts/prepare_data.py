"""Raw text (JSON lines, optionally gzip/zstd, .txt, or Parquet) → token shards + manifest: see `python scripts/prepare_data.py --help` or olmo_ds/cli/prepare_data.py."""

import sys

from olmo_ds.cli.prepare_data import main

if __name__ == "__main__":
    sys.exit(main())
