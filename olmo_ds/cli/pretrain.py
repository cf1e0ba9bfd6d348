"""Pretrain an OLMo model on DeepSpeed.

    deepspeed --hostfile hostfile scripts/pretrain.py --config configs/demo.yaml [--set optim.lr=3e-4 ...] [--resume auto]

Also runs under torchrun, Slurm's srun, or plain `python` (one rank). See olmo_ds/train/trainer.py.

Exit codes: 0 done, or stopped by SIGTERM/SIGUSR1 or the launcher's exit with a checkpoint saved; 130 stopped by
SIGINT (Ctrl-C), with a checkpoint saved once training had started; 2 a refused config or launch, a failed save, or
a non-finite loss; 3 another rank died.
"""

import argparse
import json
import os
import sys

from olmo_ds.data.dataset import DataError
from olmo_ds.ranks import LaunchError
from olmo_ds.train.config import ConfigError, load_config
from olmo_ds.train.launch import collective_failure, lost_ranks, watch_launcher
from olmo_ds.train.plan import plan_run
from olmo_ds.train.trainer import CheckpointSaveError, NonFiniteLossError, Trainer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="train config YAML (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set optim.lr=3e-4 (repeatable)")
    p.add_argument("--resume", default=None, metavar="auto|CKPT_DIR",
                   help="auto: continue from the run's newest complete checkpoint if there is one")
    p.add_argument("--init-from", default=None, metavar="PATH|HUB_ID",
                   help="start from these weights (an olmo-ds checkpoint or run, our model dir, a transformers dir, a hub id); "
                        "the same as --set init_from.path=...; ignored when --resume finds the run's own checkpoint")
    p.add_argument("--start-over", action="store_true",
                   help="run_dir holds an earlier run: move it aside (to RUN.replaced-<time>; nothing is deleted) and start a new one")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    args = p.parse_args()
    watch_launcher()  # before anything slow: a rank whose launcher is gone must not start, or train on, alone
    try:
        overrides = args.overrides + ([f"init_from.path={json.dumps(args.init_from)}"] if args.init_from else [])
        trainer = Trainer(plan_run(load_config(args.config, overrides), resume=args.resume, start_over=args.start_over))
        status = trainer.fit()
    except (ConfigError, DataError, LaunchError, NonFiniteLossError, CheckpointSaveError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the training loop took SIGINT over: nothing trained, nothing to save
        print(f"rank {os.environ.get('RANK', '0')}: interrupted before training started; nothing saved", file=sys.stderr)
        return 130
    except RuntimeError as e:
        lost = lost_ranks() if collective_failure(e) else []
        if not lost:
            raise
        print(f"error: rank {os.environ.get('RANK', '0')}: rank {', '.join(map(str, lost))} died or stopped responding "
              f"({str(e).splitlines()[0][:200]}); stopping. Restart the run with --resume auto", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(3)  # a normal exit tears down the process group, which can block on the dead rank's sockets
    trainer.close()
    return 130 if status == "interrupted" else 0


if __name__ == "__main__":
    sys.exit(main())
