"""Pretrain an OLMo model on DeepSpeed.

    deepspeed --hostfile hostfile scripts/pretrain.py --config configs/demo.yaml [--set optim.lr=3e-4 ...] [--resume auto]

Also runs under torchrun, Slurm's srun, or plain `python` (one rank). See olmo_ds/train/trainer.py.

Exit codes: 0 done, or stopped by SIGTERM/SIGUSR1 or the launcher's exit with a checkpoint saved; 130 stopped by
SIGINT (Ctrl-C), with a checkpoint saved once training had started; 2 a refused config or launch, a failed save, or
a non-finite loss; 3 another rank died.

A start that ends before training (Ctrl-C or an error while the engine is built, the reference pass, a checkpoint
that cannot be loaded) gives the run dir up as a refused one does: its lock released, and a run dir it made with
nothing in it but the lock file removed (`RunPlan.abandon`).

The process ends as soon as its work is done and flushed (`end_process`).
"""

import argparse
import atexit
import json
import logging
import os
import sys

from olmo_ds.hub import missing_path

_status = 1  # what the process ends with (`end_process`): main's return, argparse's exit, else 1 (an uncaught error)


def end_process() -> None:
    """The process's last exit handler: flush the logs and stdio and end with `_status`, without the interpreter's
    module teardown.

    `main` registers it before anything else registers one, so it runs after all of them (handlers run in reverse
    order), and after every non-daemon thread has ended (the interpreter joins those first): the run's files and
    its W&B and TensorBoard writers are closed by then. What it skips: the teardown's garbage collections over the
    ~400,000 objects torch and DeepSpeed's imports make (2-6 s a rank on 2 CPU cores, the reason `Trainer.close`
    freezes them), and the C-level exit hooks after it, where nanobind's leak check reports the objects of triton's
    bindings (imported by torch, DeepSpeed and the decode kernels whenever triton is installed) that the freeze kept
    alive: ~100 "nanobind: leaked ..." lines on stderr at every exit, about memory the process is giving back anyway.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said there
            pass
    os._exit(_status)


def main() -> int:
    global _status
    atexit.register(end_process)  # first, before the imports below register theirs: it runs last
    try:
        _status = _main()
    except SystemExit as e:  # argparse's --help and usage errors
        _status = e.code if isinstance(e.code, int) else int(e.code is not None)
        raise
    except KeyboardInterrupt:  # Ctrl-C before `_main` could catch it (its imports)
        _status = 130
        raise
    return _status


def _main() -> int:
    from olmo_ds.data.dataset import DataError
    from olmo_ds.ranks import LaunchError
    from olmo_ds.train.config import ConfigError
    from olmo_ds.train.launch import collective_failure, lost_ranks, watch_launcher
    from olmo_ds.train.trainer import CheckpointSaveError, NonFiniteLossError

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
    # Named as the flag the user typed, not the key it sets; a resume may not read it (the run's own checkpoint wins).
    if args.init_from and args.resume in (None, "none") and (missing := missing_path(args.init_from)):
        print(f"error: --init-from {args.init_from}: {missing}", file=sys.stderr)
        return 2
    watch_launcher()  # before anything slow: a rank whose launcher is gone must not start, or train on, alone
    try:
        actor = actor_role(args)
        if actor is not None:  # rl.actor_ranks: this rank only generates (olmo_ds/train/rl/actors.py)
            return actor()
        trainer = start(args)
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
    if hasattr(trainer.objective, "close"):  # rl.actor_ranks: the actors stop with the learners
        trainer.objective.close()
    trainer.close()
    return 130 if status == "interrupted" else 0


def config_of(args: argparse.Namespace):
    from olmo_ds.train.config import load_config

    return load_config(args.config, args.overrides + ([f"init_from.path={json.dumps(args.init_from)}"] if args.init_from else []))


def actor_role(args: argparse.Namespace):
    """With rl.actor_ranks: an actor rank's work (`olmo_ds.train.objective.actor_role`), else None (a learner's launch
    now counts the learners only)."""
    from olmo_ds.train.objective import actor_role as role_of

    return role_of(config_of(args))


def start(args: argparse.Namespace):
    """The run's plan and its trainer (engine built, weights loaded, DPO's reference computed). A start that ends in
    between, by an error or Ctrl-C, gives the run dir up (`RunPlan.abandon`) before the error goes on."""
    from olmo_ds.train.plan import plan_run
    from olmo_ds.train.trainer import Trainer

    plan = plan_run(config_of(args), resume=args.resume, start_over=args.start_over)
    try:
        return Trainer(plan)
    except BaseException:
        plan.abandon()
        raise


if __name__ == "__main__":
    sys.exit(main())
