"""Register OLMo's released `.npy` token files as a training source in place: see `python scripts/register_token_files.py --help` or olmo_ds/cli/register_token_files.py."""

import sys

from olmo_ds.cli.register_token_files import main

if __name__ == "__main__":
    sys.exit(main())
