"""Check on this machine that N steps straight equal K steps, a hard kill (SIGKILL) and `--resume auto`: see `python scripts/check_resume.py --help` or olmo_ds/tools/check_resume.py."""

import sys

from olmo_ds.tools.check_resume import main

if __name__ == "__main__":
    sys.exit(main())
