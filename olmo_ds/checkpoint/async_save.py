"""Checkpoints that do not stop training: a host snapshot taken in step, written in the background.

DeepSpeed's `engine.save_checkpoint` hands each file's state dict to its checkpoint engine. Ours
(`HostSnapshotEngine`) copies every tensor into host memory and returns: training may change the
weights and moments right after, the snapshot holds the step's values. Training waits only for that
copy, so it runs at the speed of the link: each file's tensors land in one block of host memory
(`HostArena`) allocated at the first save and reused by every later one, page-locked on CUDA so the
device-to-host copies are DMA, issued without waiting and synchronised once. A writer thread then
`torch.save`s the files (without zip CRC-32s, which `torch.load` never checks and which cost a core
about 0.2 s per GB; the manifest's checksum is computed as the bytes are written instead), fsyncs them,
records them in its part of the manifest, and each rank marks its part written (`rank-NNNNN.written`).

Completion keeps the blocking save's rule: rank 0 writes `train_state.json` (and moves `latest`) only
once every rank's marker is there, so a checkpoint is complete exactly when `train_state.json` exists
and a SIGKILL or a full disk at any moment leaves the previous checkpoint `latest` and resumable.
Rank 0 finds the markers by polling the filesystem between steps (`poll`), so no collective runs
beside training; the collective points are the next save and the end of training (`wait`), where all
ranks learn together whether any rank's write failed.

The writer thread, not training, waits for the deletes of pruned checkpoints, and only when the disk lacks the
room for its files (`BackgroundRemover.make_room`): dropping an 18 GB checkpoint from the page cache takes seconds.
Large records are hashed while they are written, not before (`manifest.HashingWriter`). Each completed save's
summary says where its time went (snapshot, waiting for room, writing, fsyncing the directory and the marker).

One save is in flight at a time (the next one waits for it, and so does a preemption's save);
pruning runs only after completion and only removes checkpoints older than the newest complete one,
so it never touches a save in flight; evaluation and export read complete checkpoints only.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from olmo_ds.atomic import atomic_write_bytes, fsync_path
from olmo_ds.checkpoint.layout import checkpoints_dir, step_tag
from olmo_ds.checkpoint.manifest import relative_name, write_part, write_torch
from olmo_ds.checkpoint.safe_load import load_file
from olmo_ds.checkpoint.save import barrier, finalize_checkpoint, prepare_checkpoint_dir, write_rng

log = logging.getLogger("olmo_ds")

WRITTEN = "rank-{:05d}.written"
POLL_S = 1.0  # rank 0 looks for the markers at most this often once its own part is written (a stat per rank on a shared filesystem)
PAGE = 4096  # every tensor of an arena starts on a page boundary


def written_marker(ckpt_dir: Path, rank: int) -> Path:
    return Path(ckpt_dir) / WRITTEN.format(rank)


class HostArena:
    """Host memory for one checkpoint file's tensors, allocated once and reused from save to save.

    One anonymous mapping per file rather than a pinned tensor per tensor: PyTorch's pinned allocator
    (`pin_memory=True`) rounds each block up to a power of two (a 5 GB tensor takes 8 GiB) and
    page-locks it with cudaHostAlloc, which faults and zeroes every page on one thread. Here the pages
    are faulted in on several threads (as transparent huge pages where the kernel allows), then
    page-locked with cudaHostRegister (CUDA only; elsewhere, or if that fails, the memory stays
    pageable and copies into it are plain memcpys). Each tensor is its own storage over its slice
    (`torch.frombuffer`), so `torch.save` writes what the blocking save writes, not the whole block.
    """

    def __init__(self, layout: list[tuple[torch.dtype, tuple[int, ...]]], *, pin: bool):
        self.layout = layout
        sizes = [math.prod(shape) * dtype.itemsize for dtype, shape in layout]
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += -(-size // PAGE) * PAGE
        self.nbytes = total
        self._mm = mmap.mmap(-1, max(total, PAGE))
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._mm.madvise(mmap.MADV_HUGEPAGE)
        _fault_in(self._mm)
        self.pinned_at = _page_lock(self._mm) if pin and total else None
        self.tensors = [torch.frombuffer(self._mm, dtype=dtype, count=math.prod(shape), offset=offset).view(shape) if size
                        else torch.empty(shape, dtype=dtype)
                        for (dtype, shape), size, offset in zip(layout, sizes, offsets)]

    def release(self) -> None:
        """Unlock the pages; the mapping goes with the last tensor that views it."""
        self.tensors = []
        if self.pinned_at is not None:
            torch.cuda.cudart().cudaHostUnregister(self.pinned_at)
            self.pinned_at = None


def _fault_in(mm: mmap.mmap) -> None:
    """Touch every page of `mm` once, split over threads: the kernel zeroes each page on its first touch,
    a few GB/s per thread, so one thread spends seconds on a 16 GB snapshot."""
    pages = np.frombuffer(mm, dtype=np.uint8)
    threads = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
    chunk = -(-len(pages) // (threads * PAGE)) * PAGE

    def touch(i: int) -> None:
        pages[i * chunk:(i + 1) * chunk:PAGE] = 0  # numpy releases the GIL for the loop

    with ThreadPoolExecutor(threads, thread_name_prefix="olmo_ds-fault-in") as pool:
        list(pool.map(touch, range(threads)))
    del pages


def _page_lock(mm: mmap.mmap) -> int | None:
    """cudaHostRegister the mapping; its address, or None (with a warning) where CUDA refuses."""
    view = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(view)
    del view  # a live ctypes view would pin the mmap object itself
    try:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(address, len(mm), 0))
    except Exception as e:  # noqa: BLE001 - any refusal leaves pageable memory, slower but correct
        log.warning("checkpoint: could not page-lock %.1f GiB of host memory for background saves (%s); copies to it "
                    "will be slower", len(mm) / 2**30, e)
        return None
    return address


def _map(obj, fn):
    """`obj` with every tensor inside its dicts, lists and tuples replaced by `fn(tensor)`, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        out = type(obj)((k, _map(v, fn)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):  # a module state dict's version record, which load_state_dict reads
            out._metadata = obj._metadata
        return out
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_map(v, fn) for v in obj)
    return obj  # numbers, strings, configs: not changed by training


class HostSnapshotEngine:
    """A DeepSpeed checkpoint engine (`engine.checkpoint_engine`) that queues host copies instead of writing.

    DeepSpeed calls `save(state_dict, path)` for every file of a checkpoint and `commit` at its end;
    `take()` hands the queued (path, snapshot) pairs to the writer. The snapshots live in `HostArena`s,
    one per file in DeepSpeed's order, reused while the file's tensors keep their shapes and dtypes:
    a snapshot must be written before the next one is taken (`AsyncSaver` waits for that).
    Loading is `safe_load.load_file` (weights only).
    """

    name = "olmo_ds.HostSnapshotEngine"

    def __init__(self):
        self.pending: list[tuple[str, object]] = []
        self._arenas: list[HostArena] = []
        self._file = 0
        self.alloc_s = 0.0  # seconds this checkpoint spent allocating arenas (the first save's one-time cost)

    # --- DeepSpeed's checkpoint engine interface --------------------------------------------------
    def create(self, info) -> None:
        self._file, self.alloc_s = 0, 0.0

    def makedirs(self, path, exist_ok=False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str) -> None:
        tensors: list[torch.Tensor] = []
        _map(state_dict, tensors.append)
        arena = self._arena([(t.dtype, tuple(t.shape)) for t in tensors])
        slots = iter(arena.tensors)

        def copy(t: torch.Tensor) -> torch.Tensor:
            slot = next(slots)
            return slot.copy_(t.detach(), non_blocking=True)  # device-to-host: queued; commit waits for all

        self.pending.append((str(path), _map(state_dict, copy)))

    def load(self, path: str, map_location=None):
        return load_file(path, map_location=map_location)

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
        pending, self.pending, self._file = self.pending, [], 0
        return pending

    @property
    def held_bytes(self) -> int:
        return sum(a.nbytes for a in self._arenas)

    def release(self) -> None:
        """Give the arenas' memory back (a blocking save follows; the next background save allocates anew)."""
        for arena in self._arenas:
            arena.release()
        self._arenas = []

    def _arena(self, layout: list[tuple[torch.dtype, tuple[int, ...]]]) -> HostArena:
        i, self._file = self._file, self._file + 1
        if i < len(self._arenas) and self._arenas[i].layout == layout:
            return self._arenas[i]
        t0 = time.perf_counter()
        if i < len(self._arenas):
            self._arenas[i].release()
        arena = HostArena(layout, pin=torch.cuda.is_available())
        self._arenas[i:i + 1] = [arena]
        self.alloc_s += time.perf_counter() - t0
        return arena


@contextlib.contextmanager
def _without_crc32():
    """torch.save's zip records without CRC-32 (process-wide while it lasts; only the writer saves then)."""
    get, set_ = getattr(torch.serialization, "get_crc32_options", None), getattr(torch.serialization, "set_crc32_options", None)
    if get is None or set_ is None:  # torch < 2.6 always computes them
        yield
        return
    before = get()
    set_(False)
    try:
        yield
    finally:
        set_(before)


def _free_gib(directory: Path) -> float:
    """Free space where a write failed: torch.save reports a full disk without errno, so this is what says so."""
    try:
        return shutil.disk_usage(directory).free / 2**30
    except OSError:
        return float("nan")


def snapshot_bytes_estimate(num_params: int, dp_world: int) -> int:
    """Host bytes one rank's snapshot takes: fp32 master weights and AdamW's two moments, partitioned over
    the data-parallel ranks, plus a tenth for module states and headroom."""
    return int(num_params * 12 / dp_world * 1.1)


def host_copy_fits(bytes_per_rank: int, local_ranks: int, held: int = 0) -> tuple[bool, str]:
    """Whether every rank of this node can hold its snapshot in host memory now (after any CPU offload
    already took its share), keeping a tenth of the machine and 4 GiB free; the reason either way.
    `held`: bytes each rank already holds for snapshots (its arenas, reused), which need not be found again."""
    import psutil

    mem = psutil.virtual_memory()
    need = max(bytes_per_rank - held, 0) * local_ranks
    spare = mem.available - max(0.1 * mem.total, 4 * 2**30)
    text = (f"host copy of {bytes_per_rank / 2**30:.1f} GiB x {local_ranks} rank(s) on this node"
            + (f" ({held / 2**30:.1f} GiB each already held)" if held else "")
            + f" against {mem.available / 2**30:.1f} GiB available host memory")
    return need <= spare, text


class AsyncSaver:
    """Saves through `HostSnapshotEngine` and a writer thread; see the module docstring. Collective:
    every rank calls `start` and `wait` at the same points; `poll` is rank 0's, between steps.
    `remover`: the `BackgroundRemover` deleting pruned checkpoints; the writer thread, not training, waits for
    it, and only when the disk lacks the room for this rank's files (`BackgroundRemover.make_room`)."""

    def __init__(self, engine, run_dir: str | Path, rank: int, world_size: int, *, remover=None):
        self.engine, self.run_dir, self.rank, self.world_size = engine, Path(run_dir), rank, world_size
        self.remover = remover
        self.snapshots = HostSnapshotEngine()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._in_flight: dict | None = None  # ckpt_dir, step, train_state, tokenizer_path, started, blocked, alloc
        self._phases: dict[str, float] = {}  # the writer thread's: room_s, write_s, sync_s
        self._last_poll = 0.0

    @property
    def in_flight(self) -> Path | None:
        return self._in_flight["ckpt_dir"] if self._in_flight else None

    @property
    def in_flight_blocked_s(self) -> tuple[float, float] | None:
        """(seconds `start` held training, of which allocating host memory) for the save in flight."""
        return (self._in_flight["blocked"], self._in_flight["alloc"]) if self._in_flight else None

    def start(self, step: int, train_state: dict, *, tokenizer_path, rank_files: dict | None = None) -> Path:
        """Snapshot this step's state (blocking only for the copy to host memory) and start writing it; `rank_files`
        (`save.write_rng`) are written before this returns. A save still in flight completes first (call `wait` before,
        to receive its summary)."""
        self.wait()
        t0 = time.perf_counter()
        ckpt_dir = prepare_checkpoint_dir(self.run_dir, step, self.rank)
        previous = self.engine.checkpoint_engine
        self.engine.checkpoint_engine = self.snapshots
        t_snapshot = time.perf_counter()
        try:
            self.engine.save_checkpoint(str(checkpoints_dir(self.run_dir)), tag=step_tag(step), save_latest=False)
        finally:
            self.engine.checkpoint_engine = previous
        snapshot_s = time.perf_counter() - t_snapshot
        rng_entry = write_rng(ckpt_dir, self.rank, rank_files)
        files = self.snapshots.take()
        self._error, self._phases = None, {}
        self._thread = threading.Thread(target=self._write, args=(files, ckpt_dir, rng_entry), name=f"olmo_ds-save-{step}", daemon=True)
        self._thread.start()
        self._in_flight = {"ckpt_dir": ckpt_dir, "step": step, "train_state": train_state, "tokenizer_path": tokenizer_path,
                           "started": t0, "blocked": time.perf_counter() - t0, "alloc": self.snapshots.alloc_s,
                           "snapshot": snapshot_s}
        return ckpt_dir

    def _write(self, files: list[tuple[str, object]], ckpt_dir: Path, entries: dict[str, dict]) -> None:
        try:
            entries = dict(entries)
            t0 = time.perf_counter()
            if self.remover is not None:
                self.remover.make_room(ckpt_dir, self.snapshots.held_bytes)
            t1 = time.perf_counter()
            with _without_crc32():
                for path, state in files:
                    # hashed as written, fsynced: on disk before the marker says so, as the marker itself is
                    entries[relative_name(path, ckpt_dir)] = write_torch(state, path)
            t2 = time.perf_counter()
            for directory in {Path(path).parent for path, _ in files}:
                fsync_path(directory)
            write_part(ckpt_dir, self.rank, entries)
            atomic_write_bytes(written_marker(ckpt_dir, self.rank), b"")
            self._phases = {"room_s": t1 - t0, "write_s": t2 - t1, "sync_s": time.perf_counter() - t2}
        except BaseException as e:  # reported at the next collective point; the previous checkpoint stays latest
            self._error = e
            log.warning("rank %d: writing %s failed in the background: %s: %s (%.2f GiB free there; the previous checkpoint "
                        "stays `latest`; this is raised at the next save or at the end of training)", self.rank, ckpt_dir,
                        type(e).__name__, e, _free_gib(ckpt_dir))

    def poll(self) -> dict | None:
        """Rank 0, between steps: complete the save in flight once every rank has written its part.
        Returns the save's summary when it completed now."""
        if self.rank != 0 or self._in_flight is None:
            return None
        if self._thread is not None and self._thread.is_alive():
            return None  # this rank's own part is still being written: no marker to look for yet
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
        return {"ckpt_dir": s["ckpt_dir"], "blocked_s": s["blocked"], "alloc_s": s["alloc"], "snapshot_s": s["snapshot"],
                "total_s": time.perf_counter() - s["started"], **self._phases}


class AsyncSaveError(RuntimeError):
    """A background checkpoint write failed on some rank; the checkpoint it was writing is incomplete."""

    def __init__(self, ckpt_dir: Path | None, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.ckpt_dir, self.cause = ckpt_dir, cause
