"""Check on this machine that N steps straight equal K steps, a hard kill (SIGKILL) and `--resume auto`.

    python scripts/check_resume.py --config configs/my_run.yaml --steps 6 --kill-after 4        # CPU: bit-identical
    python scripts/check_resume.py --config configs/olmo2-1b.yaml --set schedule.warmup_steps=10 \
        --steps 40 --kill-after 30 --launcher torchrun --nproc 8 --noise    # GPUs: the difference and the noise floor
    python scripts/check_resume.py ... --launcher torchrun --nproc 8 --resume-nproc 4 --tolerance 0.02   # resumed on 4 GPUs
    python scripts/check_resume.py ... --nproc 8 --resume-set parallel.sequence_parallel_size=2       # resumed with SP 2

Runs DIR/straight, then DIR/resumed (killed after its step-K checkpoint, then resumed), and with
--noise DIR/straight2; compares the losses of steps K+1..N and the final weights. Exit 0 when the
resume is bit-identical (or max |dloss| <= --tolerance), 1 when it differs, 2 on bad arguments or a
failed run (its log's tail is printed). See olmo_ds/tools/check_resume.py.

Does a hard kill and `--resume auto` reproduce an uninterrupted run on this machine?

Three real launches of `scripts/pretrain.py` with the user's config: "straight" trains N steps;
"killed" trains the same config in another run directory and is SIGKILLed as a whole (launcher and
every rank, a node losing power) as soon as its step-K checkpoint is complete; "resumed" continues
that directory with `--resume auto` to step N. The losses of steps K+1..N and the final fp32 weights
of the two runs are then compared.

On CPU in fp32 they must be bit-identical. On GPUs bf16 kernels are not bitwise deterministic, so
two uninterrupted runs already differ; `noise` adds a second straight run to measure that floor, and
the report gives the largest difference of each pair. 2K > N keeps one checkpoint (step K) between
the start and the final save, so whatever the killed run managed after K, its newest complete
checkpoint is K and the resume redoes steps K+1..N.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil  # a DeepSpeed dependency
import torch

from olmo_ds import checkpoint as ckpt
from olmo_ds.tools import package_env
from olmo_ds.train.config import ConfigError, load_config
from olmo_ds.train.launch import free_port

PRETRAIN = "olmo_ds.cli.pretrain"  # started by module name, so the check runs from an installed package too
LAUNCHERS = ("python", "torchrun", "deepspeed")
RUNS = ("straight", "resumed", "straight2")
LOGS = ("straight.log", "killed.log", "resumed.log", "straight2.log")
POLL_S = 0.01  # the killed run must be caught between its step-K and step-N saves


class RunFailed(RuntimeError):
    """A launch exited non-zero, timed out or did not behave as the check needs; `log` holds its output."""

    def __init__(self, message: str, log: Path):
        super().__init__(message)
        self.log = log


@dataclass
class ResumeCheck:
    config: Path
    steps: int  # N
    kill_after: int  # K
    work_dir: Path
    overrides: list[str] = field(default_factory=list)
    launcher: str = "python"
    nproc: int = 1
    noise: bool = False
    resume_nproc: int | None = None  # the resumed launch's ranks (default: nproc): resume on another world size
    resume_overrides: list[str] = field(default_factory=list)  # --set values of the resumed launch only (e.g. its sequence_parallel_size)
    timeout: float = 1800.0  # seconds per launch
    overwrite: bool = False  # replace the runs of an earlier check in work_dir

    def validate(self) -> None:
        """Every check that needs no run, so that a bad argument costs nothing."""
        n, k = self.steps, self.kill_after
        if not 0 < k < n:
            raise ValueError(f"--kill-after {k} must be between 1 and --steps - 1 ({n - 1})")
        if 2 * k <= n:
            raise ValueError(f"--kill-after {k} must be more than half of --steps {n}, so that step {k} is the only checkpoint "
                             f"before the final one and the resume starts from it (e.g. --steps {n} --kill-after {n // 2 + 1})")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"--launcher {self.launcher!r} is not one of {', '.join(LAUNCHERS)}")
        if self.nproc < 1 or (self.launcher == "python" and self.nproc != 1):
            raise ValueError(f"--nproc {self.nproc}: the python launcher runs one rank; use --launcher torchrun or deepspeed for more")
        if self.resume_nproc is not None and (self.resume_nproc < 1 or self.launcher == "python"):
            raise ValueError(f"--resume-nproc {self.resume_nproc}: needs --launcher torchrun or deepspeed and at least one rank")
        if self.timeout <= 0:
            raise ValueError(f"--timeout must be > 0, got {self.timeout}")
        if self.work_dir.exists() and any(self.work_dir.iterdir()) and not self.overwrite:
            raise ValueError(f"--work-dir {self.work_dir} is not empty; choose another or pass --overwrite to replace its runs")
        # The user's config with the check's settings on top must be valid (ConfigError names the file and key).
        load_config(self.config, self.run_overrides("straight"))
        load_config(self.config, [*self.run_overrides("resumed"), *self.resume_overrides])

    def run_overrides(self, name: str) -> list[str]:
        """The user's --set values, then the check's: ours win. Checkpoints at K and N only, both kept;
        every step logged; no W&B runs left behind by a check."""
        run_dir = json.dumps(str((self.work_dir / name).resolve()))  # quoted: --set values are parsed as YAML
        return [*self.overrides, f"run_dir={run_dir}", f"max_steps={self.steps}", f"checkpoint.every={self.kill_after}",
                "checkpoint.keep_last=2", "checkpoint.save_final=true", "logging.every=1", "logging.wandb=false"]

    def command(self, name: str, *extra: str, resuming: bool = False) -> list[str]:
        """The launch of run `name`; `resuming`: the resumed launch, with `resume_nproc` ranks and `resume_overrides`."""
        args = ["-m", PRETRAIN, "--config", str(self.config)]
        for o in [*self.run_overrides(name), *(self.resume_overrides if resuming else [])]:
            args += ["--set", o]
        args += extra
        nproc = self.resume_nproc if resuming and self.resume_nproc else self.nproc
        if self.launcher == "python":
            return [sys.executable, *args]
        if self.launcher == "torchrun":
            return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
        # Without a hostfile DeepSpeed's launcher runs locally on GPUs 0..P-1 (it ignores CUDA_VISIBLE_DEVICES
        # once --num_gpus is given); a free port lets two checks share a machine.
        # The `deepspeed` command is this module's wrapper; running the module needs no bin/ on PATH.
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port", str(free_port()),
                "--module", *args[1:]]


# --- launching -----------------------------------------------------------------------------------


def launch_env() -> dict[str, str]:
    """This environment, able to import olmo_ds from this checkout, and not mistaken for a rank of an outer launch."""
    env = package_env()
    env["PYTHONUNBUFFERED"] = "1"  # the log's tail is current when a run is killed
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    return env


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        return subprocess.Popen(cmd, env=launch_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process under it. torchrun starts each rank in a session of its
    own, so the launcher's process group alone would not reach them: list the descendants first."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:  # the launcher already ended
        family = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:  # ended between listing and kill
            pass
    psutil.wait_procs(family, timeout=30)
    proc.wait()


def wait(proc: subprocess.Popen, name: str, log: Path, timeout: float) -> None:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(proc)
        raise RunFailed(f"{name}: still running after {timeout:g} s (--timeout); killed", log) from None
    if code != 0:
        raise RunFailed(f"{name}: exit code {code}", log)


def train(check: ResumeCheck, name: str, log_name: str, *extra: str, resuming: bool = False) -> None:
    log = check.work_dir / log_name
    wait(start(check.command(name, *extra, resuming=resuming), log), log_name.removesuffix(".log"), log, check.timeout)


def train_and_kill(check: ResumeCheck) -> int:
    """The "killed" launch: SIGKILL it once its step-K checkpoint is complete. Returns the last step it logged."""
    log = check.work_dir / "killed.log"
    run_dir = check.work_dir / "resumed"
    target = ckpt.checkpoints_dir(run_dir) / ckpt.step_tag(check.kill_after)
    proc = start(check.command("resumed"), log)
    deadline = time.monotonic() + check.timeout
    try:
        while not ckpt.is_complete(target):
            code = proc.poll()
            if code == 0:
                raise RunFailed(f"killed: the run reached step {check.steps} before its step-{check.kill_after} checkpoint "
                                f"was seen; raise --steps (and --kill-after) so the kill lands mid-run", log)
            if code is not None:
                raise RunFailed(f"killed: exit code {code} before the step-{check.kill_after} checkpoint", log)
            if time.monotonic() > deadline:
                raise RunFailed(f"killed: no step-{check.kill_after} checkpoint after {check.timeout:g} s (--timeout)", log)
            time.sleep(POLL_S)
    finally:
        kill_all(proc)
    newest = ckpt.list_checkpoints(ckpt.checkpoints_dir(run_dir))[-1][0]
    if newest != check.kill_after:
        raise RunFailed(f"killed: the run saved step {newest} before the kill landed; raise --steps (and --kill-after)", log)
    return max((m["step"] for m in read_metrics(run_dir)), default=0)


# --- comparing -----------------------------------------------------------------------------------


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / ckpt.METRICS
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses_by_step(run_dir: str | Path) -> dict[int, float]:
    """Loss per step from metrics.jsonl (logging.every = 1); a resumed run's lines override older ones."""
    return {m["step"]: m["train/loss"] for m in read_metrics(run_dir) if "train/loss" in m}


def compare_losses(ref: dict[int, float], other: dict[int, float], steps: range) -> dict:
    """Per step of `steps`: the reference run's loss ("ref"), the other run's and |difference|; the largest."""
    missing = [s for s in steps if s not in ref or s not in other]
    if missing:
        raise ValueError(f"no train/loss logged for steps {missing} in one of the runs' metrics.jsonl")
    rows = [{"step": s, "ref": ref[s], "other": other[s], "abs_diff": abs(other[s] - ref[s])} for s in steps]
    worst = max(rows, key=lambda r: r["abs_diff"])
    return {"rows": rows, "max_abs_dloss": worst["abs_diff"], "max_dloss_step": worst["step"] if worst["abs_diff"] else None,
            "losses_identical": all(r["ref"] == r["other"] for r in rows)}


def compare_weights(ref: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> dict:
    """The largest |difference| of one weight and its tensor; ||dw|| / ||w|| over all weights together."""
    if ref.keys() != other.keys():
        raise ValueError(f"the final checkpoints hold different tensors: {sorted(ref.keys() ^ other.keys())}")
    max_dw, where, sq_diff, sq_ref = 0.0, None, 0.0, 0.0
    for name, a in ref.items():
        diff = (other[name].double() - a.double()).abs()
        if diff.numel() and diff.max().item() > max_dw:
            max_dw, where = diff.max().item(), name
        sq_diff += diff.square().sum().item()
        sq_ref += a.double().square().sum().item()
    return {"max_abs_dw": max_dw, "max_dw_tensor": where, "rel_dw": math.sqrt(sq_diff / sq_ref) if sq_ref else math.sqrt(sq_diff),
            "weights_identical": all(torch.equal(a, other[n]) for n, a in ref.items())}


def load_weights(run_dir: Path, step: int) -> tuple:
    """`load_model_state` of the run's step checkpoint, without DeepSpeed's progress lines in the report."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return ckpt.load_model_state(ckpt.checkpoints_dir(run_dir) / ckpt.step_tag(step))


def compare(ref: dict, ref_weights: dict, other_dir: Path, steps: range, final_step: int) -> dict:
    """Losses over `steps` and final weights of `other_dir` against a reference run's."""
    _, weights, _ = load_weights(other_dir, final_step)
    report = {**compare_losses(ref, losses_by_step(other_dir), steps), **compare_weights(ref_weights, weights)}
    report["identical"] = report["losses_identical"] and report["weights_identical"]
    return report


def verdict(report: dict, tolerance: float | None) -> tuple[int, str]:
    """(exit code, one line): 0 when bit-identical or max |dloss| <= tolerance, else 1."""
    r = report["resume"]
    if r["identical"]:
        return 0, f"PASS: resume is bit-identical to the straight run (losses of steps {report['compared_steps']}, final weights)"
    noise = report.get("noise")
    floor = f"; two straight runs differ by up to {noise['max_abs_dloss']:.3g} in loss" if noise else \
        " (--noise measures the device's run-to-run floor)"
    loss = "identical losses" if r["losses_identical"] else f"up to {r['max_abs_dloss']:.3g} in loss (step {r['max_dloss_step']})"
    weights = "identical weights" if r["weights_identical"] else f"up to {r['max_abs_dw']:.3g} in weights ({r['max_dw_tensor']})"
    diff = f"resume differs from the straight run: {loss}, {weights}{floor}"
    if tolerance is not None and r["max_abs_dloss"] <= tolerance:
        return 0, f"PASS within --tolerance {tolerance:g}: {diff}"
    return 1, f"FAIL: {diff}; " + (f"above --tolerance {tolerance:g}" if tolerance is not None else "not bit-identical and no --tolerance given")


def format_report(report: dict) -> str:
    r, noise = report["resume"], report.get("noise")
    lines = [f"{'step':>6}  {'straight':>16}  {'resumed':>16}  {'|dloss|':>9}" + (f"  {'straight2':>16}" if noise else "")]
    for i, row in enumerate(r["rows"]):
        line = f"{row['step']:>6}  {row['ref']:>16.10f}  {row['other']:>16.10f}  {row['abs_diff']:>9.3g}"
        lines.append(line + (f"  {noise['rows'][i]['other']:>16.10f}" if noise else ""))
    pairs = [("resume vs straight", r)] + ([("straight2 vs straight (noise)", noise)] if noise else [])
    lines.append("")
    lines.append(f"{'':<22}" + "".join(f"{name:>32}" for name, _ in pairs))
    rows = [("max |dloss| (step)", lambda p: f"{p['max_abs_dloss']:.3g} (step {p['max_dloss_step'] or '-'})"),
            ("max |dw| (tensor)", lambda p: f"{p['max_abs_dw']:.3g} ({p['max_dw_tensor'] or '-'})"),
            ("||dw|| / ||w||", lambda p: f"{p['rel_dw']:.3g}"),
            ("bit-identical", lambda p: "yes" if p["identical"] else "no")]
    for label, fmt in rows:
        lines.append(f"{label:<22}" + "".join(f"{fmt(p):>32}" for _, p in pairs))
    return "\n".join(lines)


# --- the check -----------------------------------------------------------------------------------


def run_check(check: ResumeCheck, say=print) -> dict:
    """Run the launches and compare; returns the report (see `verdict`). Raises RunFailed, ValueError."""
    check.validate()
    check.work_dir.mkdir(parents=True, exist_ok=True)
    for name in RUNS:  # only what this check writes; nothing else under (or outside) the work dir
        shutil.rmtree(check.work_dir / name, ignore_errors=True)
    for name in LOGS:
        (check.work_dir / name).unlink(missing_ok=True)
    n, k, wd = check.steps, check.kill_after, check.work_dir

    t0 = time.monotonic()
    say(f"straight: {n} steps -> {wd / 'straight'} (log {wd / 'straight.log'})")
    train(check, "straight", "straight.log")
    say(f"killed: the same run in {wd / 'resumed'}, SIGKILLed after its step-{k} checkpoint ({time.monotonic() - t0:.0f} s so far)")
    killed_at = train_and_kill(check)
    other = "".join([f" on {check.resume_nproc} ranks" if check.resume_nproc else "",
                     f" with {' '.join(check.resume_overrides)}" if check.resume_overrides else ""])
    say(f"resumed: --resume auto from step {k} to {n}{other} (the killed run had logged step {killed_at})")
    train(check, "resumed", "resumed.log", "--resume", "auto", resuming=True)
    if check.noise:
        say(f"straight2: {n} steps again, for the run-to-run noise floor")
        train(check, "straight2", "straight2.log")
    say(f"comparing steps {k + 1}..{n} and the step-{n} weights ({time.monotonic() - t0:.0f} s of training)")

    steps = range(k + 1, n + 1)
    _, ref_weights, state = load_weights(wd / "straight", n)
    ref = losses_by_step(wd / "straight")
    return {
        "config": str(check.config), "overrides": check.overrides, "steps": n, "kill_after": k, "launcher": check.launcher,
        "nproc": check.nproc, "resume_nproc": check.resume_nproc or check.nproc, "resume_overrides": check.resume_overrides,
        "work_dir": str(wd), "killed_at_step": killed_at, "compared_steps": f"{k + 1}-{n}",
        "precision": state["config"]["precision"], "world_size": state["world_size"], "zero_stage": state["zero_stage"],
        "versions": state["versions"],
        "resume": compare(ref, ref_weights, wd / "resumed", steps, n),
        "noise": compare(ref, ref_weights, wd / "straight2", steps, n) if check.noise else None,
    }


def main(argv: list[str] | None = None) -> int:
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
    p.add_argument("--resume-nproc", type=int, default=None, help="ranks of the resumed launch (default --nproc): resume on another world size")
    p.add_argument("--resume-set", dest="resume_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="train config values of the resumed launch only, e.g. parallel.sequence_parallel_size=2")
    p.add_argument("--work-dir", type=Path, default=Path("runs/check_resume"), help="where the runs and their logs go")
    p.add_argument("--overwrite", action="store_true", help="replace the runs of an earlier check in --work-dir")
    p.add_argument("--noise", action="store_true", help="also run straight twice: the device's run-to-run difference")
    p.add_argument("--tolerance", type=float, default=None, help="pass when max |dloss| <= this (default: bit-identical only)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per launch before it is killed")
    p.add_argument("--json", type=Path, default=None, help="also write every number here")
    args = p.parse_args(argv)

    check = ResumeCheck(config=args.config, steps=args.steps, kill_after=args.kill_after, work_dir=args.work_dir,
                        overrides=args.overrides, launcher=args.launcher, nproc=args.nproc, noise=args.noise,
                        timeout=args.timeout, overwrite=args.overwrite, resume_nproc=args.resume_nproc,
                        resume_overrides=args.resume_overrides)
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
