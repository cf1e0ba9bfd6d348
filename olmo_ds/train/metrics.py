"""Progress reporting on rank 0: a console line with ETA, metrics.jsonl, TensorBoard, optional W&B.

Every step is logged once: a run that continues from a checkpoint at step S first moves the metrics.jsonl lines
of steps after S (logged by the process that went on past its last checkpoint, then died) aside
(`roll_back_metrics`), and its TensorBoard writer hides the old event files' steps from S + 1 on
(`purge_step`); the steps are then logged again by the resumed run.

Throughput figures follow one FLOP formula (`ModelConfig.flops_per_token`: 6 x every parameter but
the input embedding (output head included) + 12 x layers x d_model x seq_len per token, fwd + bwd),
printed once at start so MFU numbers can be compared with other trainers' on the same footing.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import resource
import secrets
import sys
import time
from pathlib import Path

import torch

from olmo_ds.checkpoint import METRICS, WANDB_ID

log = logging.getLogger("olmo_ds")


# Dense bf16 peak TFLOP/s per device by datasheet, for MFU. Matched as substrings of the device name.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0, "B200": 2250.0}


def setup_console_logging(rank: int) -> None:
    """olmo-ds's own lines: INFO on rank 0, warnings only elsewhere, so N ranks do not print N copies."""
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
        log.addHandler(handler)
        log.propagate = False


def peak_tflops(override: float | None) -> float | None:
    if override:
        return override
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, value in PEAK_TFLOPS.items():
            if key in name:
                return value
    return None


def memory_gib() -> float:
    """Peak accelerator memory on GPU; on CPU, the process's peak resident set size."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def wandb_run_id(run_dir: Path) -> str:
    """The W&B run id of `run_dir`, chosen at its first start and kept in RUN/wandb_id.

    Every later start in the same run directory (`--resume auto` after preemption or a crash) passes
    the same id with resume="allow", so W&B continues one run instead of opening one per restart. A
    random id rather than one derived from the path: two clusters' `runs/demo` must not collide.
    """
    path = run_dir / WANDB_ID
    if path.exists():
        return path.read_text().strip()
    run_id = secrets.token_hex(6)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)
    return run_id


def start_wandb(run_dir: Path, project: str, config: dict, others: str):
    """The W&B run for `run_dir` (files under RUN/wandb/), or None with a warning when W&B cannot start.

    The mode comes from the environment (WANDB_MODE=offline writes RUN/wandb/offline-run-*/ for a
    later `wandb sync`). A missing API key, an unreachable server or an init timeout
    (WANDB_INIT_TIMEOUT, 90 s by default) must not stop a job on a thousand GPUs, so any error here
    is a warning and the scalars still go to `others` (metrics.jsonl, TensorBoard).
    """
    try:
        import wandb
    except ImportError:
        log.warning("logging.wandb is true but wandb is not installed (pip install -e '.[wandb]'); logging to %s only", others)
        return None
    try:
        run_id = wandb_run_id(run_dir)
        return wandb.init(project=project, dir=str(run_dir), id=run_id, name=run_dir.name, resume="allow", config=config)
    except Exception as e:  # noqa: BLE001 - UsageError without an API key, CommError without the server, and others
        log.warning("W&B could not start (%s: %s); training continues, logging to %s only. Check `wandb login` or "
                    "WANDB_API_KEY and the network, or set WANDB_MODE=offline and `wandb sync %s/wandb/offline-run-*` later",
                    type(e).__name__, e, others, run_dir)
        return None


def _line_step(line: bytes) -> int | None:
    """The step of a whole metrics.jsonl line; None for a line cut off by a kill (or not ours)."""
    if not line.endswith(b"\n"):
        return None
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


def roll_back_metrics(run_dir: Path, step: int) -> tuple[Path, int, str] | None:
    """Move the lines of RUN/metrics.jsonl logged after `step`, the step the run continues from (0: from the start),
    to RUN/metrics.jsonl.after-step-<step>-<UTC time>, so that the continued run logs each step once.

    A line cut off by a kill goes with them. Nothing is deleted: the moved lines are the record of what the
    process that died had trained past its last checkpoint. Both files are complete at every moment (the kept
    lines are written to a temporary file renamed over metrics.jsonl). Returns (the file the lines went to,
    how many, "steps A-B"), or None when no line is past `step` (then nothing is read but the file's tail).
    """
    path = run_dir / METRICS
    if not path.is_file():
        return None
    with open(path, "rb") as f:  # the common case, a clean stop: the last line is of the checkpoint's step (steps only rise)
        f.seek(max(f.seek(0, os.SEEK_END) - 65536, 0))
        tail = f.read().splitlines(keepends=True)
    last = _line_step(tail[-1]) if tail else 0
    if last is not None and last <= step:
        return None
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    aside, n = run_dir / f"{METRICS}.after-step-{step}-{stamp}", 1
    while aside.exists():  # two resumes within a second
        aside, n = run_dir / f"{METRICS}.after-step-{step}-{stamp}-{n}", n + 1
    kept_tmp = path.with_name(path.name + ".tmp")
    moved, steps = 0, []
    with open(path, "rb") as src, open(kept_tmp, "wb") as kept, open(aside, "xb") as gone:
        for line in src:
            line_step = _line_step(line)
            if line_step is not None and line_step <= step:
                kept.write(line)
            else:
                gone.write(line if line.endswith(b"\n") else line + b"\n")
                moved += 1
                steps += [line_step] if line_step is not None else []
        for f in (kept, gone):
            f.flush()
            os.fsync(f.fileno())
    if not moved:
        os.unlink(kept_tmp)
        os.unlink(aside)
        return None
    os.replace(kept_tmp, path)
    return aside, moved, f"steps {min(steps)}-{max(steps)}" if steps else "a line cut off by a kill"


def tensorboard_purge_step(run_dir: Path, step: int) -> int | None:
    """The `purge_step` for a TensorBoard writer of a run continuing from `step`: step + 1 when RUN/tb/ already holds
    event files (their steps from there on are hidden: the continued run logs them again), else None."""
    tb = run_dir / "tb"
    return step + 1 if tb.is_dir() and any(tb.glob("events.out.tfevents.*")) else None


class MetricsLogger:
    """Writes scalars on rank 0 only; other ranks hold a disabled instance. `purge_step`: see `tensorboard_purge_step`."""

    def __init__(self, run_dir: Path, *, enabled: bool, tensorboard: bool, wandb: bool, wandb_project: str, config: dict,
                 purge_step: int | None = None):
        self.enabled = enabled
        self.tb = None
        self.wandb = None
        self.jsonl = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(run_dir / METRICS, "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=purge_step)
        self.others = "metrics.jsonl and TensorBoard" if tensorboard else "metrics.jsonl"
        if wandb:
            self.wandb = start_wandb(run_dir, wandb_project, config, self.others)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        metrics = {k: v for k, v in metrics.items() if v is not None}  # a metric with nothing to measure is absent, not null
        record = {"step": step, "time": round(time.time(), 3), **metrics}
        self.jsonl.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in metrics.items():
                if value is not None:
                    self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            try:
                self.wandb.log({key: value for key, value in metrics.items() if value is not None}, step=step)
            except Exception as e:  # noqa: BLE001 - e.g. its wandb-core process was killed; training goes on
                self._drop_wandb(f"logging step {step}", e)

    def _drop_wandb(self, doing: str, error: Exception) -> None:
        log.warning("W&B failed while %s (%s: %s); W&B is off for the rest of this process, logging to %s only",
                    doing, type(error).__name__, error, self.others)
        self.wandb = None

    def close(self) -> None:
        """Called from the training loop's `finally`: an exception on its way up marks the W&B run failed."""
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            try:
                self.wandb.finish(exit_code=1 if sys.exc_info()[0] is not None else 0)
            except Exception as e:  # noqa: BLE001 - a W&B error must not change how training ends
                self._drop_wandb("finishing its run", e)


def console_line(step: int, max_steps: int, m: dict[str, float], eta_s: float) -> str:
    parts = [
        f"step {step}/{max_steps}",
        f"loss {m['train/loss']:.4f}",
        f"lr {m['train/lr']:.2e}",
        f"gnorm {m['train/grad_norm']:.3f}" if m.get("train/grad_norm") is not None else "gnorm -",
        f"{m['perf/tokens_per_s']:,.0f} tok/s",
    ]
    if m.get("train/trained_tokens") is not None:  # fine-tuning
        parts.append(f"trained {m['train/trained_tokens']:,} tok, packing {100 * m['data/packing_efficiency']:.1f}%")
    if m.get("rewards/accuracy") is not None:  # preference tuning
        parts.append(f"{m['train/pairs']} pairs, acc {m['rewards/accuracy']:.3f}, margin {m['rewards/margin']:.3f}")
    if m.get("rollout/reward_mean") is not None:  # RL: the rollout's rewards and where the step's time went
        parts.append(f"reward {m['rollout/reward_mean']:.3f}, solved {100 * m['rollout/solve_rate']:.1f}%, dropped "
                     f"{m['rollout/dropped_groups']}/{m['rollout/groups']} groups, gen {m['time/generation_s']:.1f}s")
    if m.get("perf/mfu") is not None:
        parts.append(f"MFU {100 * m['perf/mfu']:.1f}%")
    parts.append(f"data {100 * m['perf/data_wait_fraction']:.1f}%")
    if m.get("perf/float8_matmul_fraction") is not None:
        parts.append(f"fp8 {100 * m['perf/float8_matmul_fraction']:.0f}%")
    parts.append(f"mem {m['perf/memory_gib']:.1f}G")
    parts.append(f"ETA {format_duration(eta_s)}")
    return " | ".join(parts)
