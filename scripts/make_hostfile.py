"""Write a DeepSpeed hostfile that fits this machine or Slurm allocation (`make hostfile`).

    python scripts/make_hostfile.py [--output hostfile] [--force]

`localhost slots=<visible GPUs>` (2 on a CPU-only machine), or one line per node of SLURM_JOB_NODELIST.
An existing, different hostfile is kept (and shown beside what would be written) unless --force.
See olmo_ds/train/hostfile.py.
"""

import argparse
import sys
from pathlib import Path

from olmo_ds.train.hostfile import hostfile_text, write_hostfile


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=Path, default=Path("hostfile"), help="where to write it (default: ./hostfile)")
    p.add_argument("--force", action="store_true", help="replace an existing hostfile that says something else")
    args = p.parse_args()
    text = hostfile_text()
    if write_hostfile(args.output, text, force=args.force):
        print(f"wrote {args.output}:\n{text}", end="")
        return 0
    print(f"kept {args.output}, which differs from what fits here (rewrite it with `make hostfile FORCE=1` or --force):\n"
          f"--- {args.output}\n{args.output.read_text()}--- would write\n{text}", end="", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
