"""Build and install FlashAttention-3 for this machine's Hopper GPU (`make flash-attn`): see
`python scripts/build_flash_attn.py --help` or olmo_ds/tools/flash_attn_build.py."""

import sys

from olmo_ds.tools.flash_attn_build import main

if __name__ == "__main__":
    sys.exit(main())
