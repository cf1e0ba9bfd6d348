"""Masked shards (prepare_data.py --format chat) → open-instruct's OLMo-core SFT layout: see `python scripts/export_olmocore_sft.py --help` or olmo_ds/cli/export_olmocore_sft.py."""

import sys

from olmo_ds.cli.export_olmocore_sft import main

if __name__ == "__main__":
    sys.exit(main())
