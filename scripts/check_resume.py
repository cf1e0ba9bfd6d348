"""Check on this machine that N steps straight equal K steps, a hard kill (SIGKILL) and `--resume auto`.

    python scripts/check_resume.py --config configs/my_run.yaml --steps 6 --kill-after 4        # CPU: bit-identical
    python scripts/check_resume.py --config configs/olmo2-1b.yaml --set schedule.warmup_steps=10 \\
        --steps 40 --kill-after 30 --launcher torchrun --nproc 8 --noise    # GPUs: the difference and the noise floor

Runs DIR/straight, then DIR/resumed (killed after its step-K checkpoint, then resumed), and with
--noise DIR/straight2; compares the losses of steps K+1..N and the final weights. Exit 0 when the
resume is bit-identical (or max |dloss| <= --tolerance), 1 when it differs, 2 on bad arguments or a
failed run (its log's tail is printed). See olmo_ds/train/resume_check.py.
"""

import argparse
import json
import sys
from pathlib import Path

from olmo_ds.train.config import ConfigError
from olmo_ds.train.resume_check import LAUNCHERS, ResumeCheck, RunFailed, format_report, run_check, verdict


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, type=Path, help="train config YAML (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, as for scripts/pretrain.py (repeatable)")
    p.add_argument("--steps", type=int, required=True, help="N: steps of every run")
    p.add_argument("--kill-after", type=int, required=True, help="K: kill the second run after its step-K checkpoint (N/2 < K < N)")
    p.add_argument("--launcher", choices=LAUNCHERS, default="python",
                   help="python: one rank, no launcher (default); torchrun; deepspeed (uses GPUs 0..P-1 whatever "
                        "CUDA_VISIBLE_DEVICES says; torchrun honours it)")
    p.add_argument("--nproc", type=int, default=1, help="ranks for torchrun / deepspeed")
    p.add_argument("--work-dir", type=Path, default=Path("runs/check_resume"), help="where the runs and their logs go")
    p.add_argument("--overwrite", action="store_true", help="replace the runs of an earlier check in --work-dir")
    p.add_argument("--noise", action="store_true", help="also run straight twice: the device's run-to-run difference")
    p.add_argument("--tolerance", type=float, default=None, help="pass when max |dloss| <= this (default: bit-identical only)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per launch before it is killed")
    p.add_argument("--json", type=Path, default=None, help="also write every number here")
    args = p.parse_args()

    check = ResumeCheck(config=args.config, steps=args.steps, kill_after=args.kill_after, work_dir=args.work_dir,
                        overrides=args.overrides, launcher=args.launcher, nproc=args.nproc, noise=args.noise,
                        timeout=args.timeout, overwrite=args.overwrite)
    try:
        report = run_check(check, say=lambda line: print(line, flush=True))
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        tail = e.log.read_text(errors="replace")[-6000:] if e.log.exists() else ""
        print(f"--- tail of {e.log}\n{tail}\n---\nerror: {e} (full log: {e.log})", file=sys.stderr)
        return 2
    code, line = verdict(report, args.tolerance)
    report["tolerance"], report["passed"], report["verdict"] = args.tolerance, code == 0, line
    print(format_report(report))
    print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
