"""Check checkpoints against their manifests (sizes, checksums, no pickled code): see `python scripts/verify_checkpoint.py --help` or olmo_ds/checkpoint/verify.py."""

import sys

from olmo_ds.checkpoint.verify import main

if __name__ == "__main__":
    sys.exit(main())
