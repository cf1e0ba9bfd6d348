"""Checkpoints that do not stop training: a host snapshot taken in step, written in the background.

DeepSpeed's `engine.save_checkpoint` hands each file's state dict to its checkpoint engine. Ours
(`HostSnapshotEngine`) copies every tensor to host memory (pinned buffers reused from save to save, so
the copy runs at PCIe speed) and returns: training may change the weights and moments right after,
the snapshot holds the step's values. A writer thread then `torch.save`s the files, and each rank
marks its part written (`rank-NNNNN.written`). Completion keeps the blocking save's rule: rank 0 writes
`train_state.json` (and moves `latest`) only once every rank's marker is there, so a checkpoint is
complete exactly when `train_state.json` exists and a SIGKILL or a full disk at any moment leaves the
previous checkpoint `latest` and resumable. Rank 0 finds the markers by polling the filesystem between
steps (`poll`), so no collective runs beside training; the collective points are the next save and the
end of training (`wait`), where all ranks learn together whether any rank's write failed.

One save is in flight at a time (the next one waits for it); pruning runs only after completion and
only removes checkpoints older than the newest complete one, so it never touches a save in flight;
evaluation and export read complete checkpoints only.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch

from olmo_ds.atomic import atomic_write_bytes
from olmo_ds.checkpoint.layout import checkpoints_dir, step_tag
from olmo_ds.checkpoint.save import barrier, finalize_checkpoint, prepare_checkpoint_dir, write_rng

log = logging.getLogger("olmo_ds")

WRITTEN = "rank-{:05d}.written"
POLL_S = 1.0  # rank 0 looks for the markers at most this often (a stat per rank on a shared filesystem)


def written_marker(ckpt_dir: Path, rank: int) -> Path:
    return Path(ckpt_dir) / WRITTEN.format(rank)


class HostSnapshotEngine:
    """A DeepSpeed checkpoint engine (`engine.checkpoint_engine`) that queues host copies instead of writing.

    DeepSpeed calls `save(state_dict, path)` for every file of a checkpoint and `commit` at its end;
    `take()` hands the queued (path, snapshot) pairs to the writer. Loading is plain `torch.load`.
    """

    name = "olmo_ds.HostSnapshotEngine"

    def __init__(self):
        self.pending: list[tuple[str, object]] = []
        self._buffers: list[torch.Tensor] = []  # pinned host buffers, reused in order from save to save
        self._next = 0

    # --- DeepSpeed's checkpoint engine interface --------------------------------------------------
    def create(self, info) -> None:
        self._next = 0

    def makedirs(self, path, exist_ok=False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str) -> None:
        self.pending.append((str(path), self._snapshot(state_dict)))

    def load(self, path: str, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info) -> bool:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        return True

    def is_data_parallel_writer(self, dp_rank) -> bool:
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        return False

    def set_commit_info(self, info) -> None:
        pass

    def get_commit_info(self):
        return None

    def cleanup(self) -> None:
        pass

    def preserves_storage_sharing(self) -> bool:
        return False  # the snapshot copies every tensor already; DeepSpeed need not clone them first

    # --- snapshots ---------------------------------------------------------------------------------
    def take(self) -> list[tuple[str, object]]:
        pending, self.pending = self.pending, []
        return pending

    def _snapshot(self, obj):
        if isinstance(obj, torch.Tensor):
            return self._host_copy(obj.detach())
        if isinstance(obj, dict):
            return type(obj)((k, self._snapshot(v)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(self._snapshot(v) for v in obj)
        return obj  # numbers, strings, configs: not changed by training

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t.clone()
        i, self._next = self._next, self._next + 1
        if i < len(self._buffers) and self._buffers[i].shape == t.shape and self._buffers[i].dtype == t.dtype:
            buf = self._buffers[i]
        else:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._buffers[i:i + 1] = [buf]
        buf.copy_(t, non_blocking=True)
        return buf


def snapshot_bytes_estimate(num_params: int, dp_world: int) -> int:
    """Host bytes one rank's snapshot takes: fp32 master weights and AdamW's two moments, partitioned over
    the data-parallel ranks, plus a tenth for module states and headroom."""
    return int(num_params * 12 / dp_world * 1.1)


def host_copy_fits(bytes_per_rank: int, local_ranks: int) -> tuple[bool, str]:
    """Whether every rank of this node can hold its snapshot in host memory now (after any CPU offload
    already took its share), keeping a tenth of the machine and 4 GiB free; the reason either way."""
    import psutil

    mem = psutil.virtual_memory()
    need = bytes_per_rank * local_ranks
    spare = mem.available - max(0.1 * mem.total, 4 * 2**30)
    text = (f"host copy of {bytes_per_rank / 2**30:.1f} GiB x {local_ranks} rank(s) on this node against "
            f"{mem.available / 2**30:.1f} GiB available host memory")
    return need <= spare, text


class AsyncSaver:
    """Saves through `HostSnapshotEngine` and a writer thread; see the module docstring. Collective:
    every rank calls `start` and `wait` at the same points; `poll` is rank 0's, between steps."""

    def __init__(self, engine, run_dir: str | Path, rank: int, world_size: int):
        self.engine, self.run_dir, self.rank, self.world_size = engine, Path(run_dir), rank, world_size
        self.snapshots = HostSnapshotEngine()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._in_flight: dict | None = None  # ckpt_dir, step, train_state, tokenizer_path, started, blocked
        self._last_poll = 0.0

    @property
    def in_flight(self) -> Path | None:
        return self._in_flight["ckpt_dir"] if self._in_flight else None

    def start(self, step: int, train_state: dict, *, tokenizer_path) -> Path:
        """Snapshot this step's state (blocking only for the device-to-host copy) and start writing it."""
        self.wait()
        t0 = time.perf_counter()
        ckpt_dir = prepare_checkpoint_dir(self.run_dir, step, self.rank)
        previous = self.engine.checkpoint_engine
        self.engine.checkpoint_engine = self.snapshots
        try:
            self.engine.save_checkpoint(str(checkpoints_dir(self.run_dir)), tag=step_tag(step), save_latest=False)
        finally:
            self.engine.checkpoint_engine = previous
        write_rng(ckpt_dir, self.rank)
        files = self.snapshots.take()
        self._error = None
        self._thread = threading.Thread(target=self._write, args=(files, ckpt_dir), name=f"olmo_ds-save-{step}", daemon=True)
        self._thread.start()
        self._in_flight = {"ckpt_dir": ckpt_dir, "step": step, "train_state": train_state, "tokenizer_path": tokenizer_path,
                           "started": t0, "blocked": time.perf_counter() - t0}
        return ckpt_dir

    def _write(self, files: list[tuple[str, object]], ckpt_dir: Path) -> None:
        try:
            for path, state in files:
                torch.save(state, path)
            atomic_write_bytes(written_marker(ckpt_dir, self.rank), b"")
        except BaseException as e:  # reported at the next collective point; the previous checkpoint stays latest
            self._error = e
            log.warning("rank %d: writing %s failed in the background: %s: %s (the previous checkpoint stays `latest`; "
                        "this is raised at the next save or at the end of training)", self.rank, ckpt_dir, type(e).__name__, e)

    def poll(self) -> dict | None:
        """Rank 0, between steps: complete the save in flight once every rank has written its part.
        Returns the save's summary when it completed now."""
        if self.rank != 0 or self._in_flight is None:
            return None
        now = time.monotonic()
        if now - self._last_poll < POLL_S:
            return None
        self._last_poll = now
        ckpt_dir = self._in_flight["ckpt_dir"]
        if not all(written_marker(ckpt_dir, r).exists() for r in range(self.world_size)):
            return None
        return self._complete()

    def wait(self) -> dict | None:
        """Collective: every rank's writes are done; if any failed, every rank raises it; rank 0 completes
        the checkpoint. Returns the save's summary on rank 0 when this call completed it."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        failed = torch.tensor(float(self._error is not None))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if torch.distributed.get_backend() == "nccl":
                failed = failed.cuda()
            torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
        if failed.item():
            in_flight, self._in_flight = self._in_flight, None
            error = self._error or RuntimeError("another rank's write failed (its log names the error)")
            raise AsyncSaveError(in_flight["ckpt_dir"] if in_flight else None, error)
        summary = self._complete() if self.rank == 0 and self._in_flight is not None else None
        self._in_flight = None
        barrier()
        return summary

    def _complete(self) -> dict:
        s = self._in_flight
        finalize_checkpoint(s["ckpt_dir"], s["step"], s["train_state"], tokenizer_path=s["tokenizer_path"])
        self._in_flight = None
        return {"ckpt_dir": s["ckpt_dir"], "blocked_s": s["blocked"], "total_s": time.perf_counter() - s["started"]}


class AsyncSaveError(RuntimeError):
    """A background checkpoint write failed on some rank; the checkpoint it was writing is incomplete."""

    def __init__(self, ckpt_dir: Path | None, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.ckpt_dir, self.cause = ckpt_dir, cause
