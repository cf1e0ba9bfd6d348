"""What a checkpoint holds, file by file: each file's size and a checksum computed while it was written.

    RUN/checkpoints/step-NNNNNNN/manifest.json
        {"format": 1, "files": {"zero_pp_rank_0_mp_rank_00_model_states.pt": {"size": 13401, "checksum": "xxh3_64:9a0c..."}, ...}}

Every file of a checkpoint goes through `write_torch` (or `entry_of_bytes` for bytes already in memory):
the bytes `torch.save` produces are hashed as they pass on their way to the file, so a save reads nothing
back. Each rank records its own files in `manifest-rankNNNNN.json`; rank 0 merges the parts into
`manifest.json` before `train_state.json` marks the checkpoint complete. The checksum is xxh3-64 where the
`xxhash` package is installed (about 15 GB/s on one core), else zlib's CRC-32 (about 4 GB/s).

Readers check a file's size always and its checksum as they load it (`check_file`; `load_file` calls it),
unless OLMO_DS_CHECKPOINT_VERIFY=sizes; `olmo_ds.checkpoint.verify` checks whole checkpoints, which is how
`--resume auto` passes over a damaged one. A checkpoint without a manifest was written by an earlier
olmo-ds: it still loads (safely), with nothing to compare its files against.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import zlib
from pathlib import Path

import torch

from olmo_ds.atomic import atomic_write_json

log = logging.getLogger("olmo_ds")

MANIFEST = "manifest.json"
PART = "manifest-rank{:05d}.json"
FORMAT = 1
VERIFY_ENV = "OLMO_DS_CHECKPOINT_VERIFY"
LEVELS = ("sizes", "auto", "full")
SMALL_BYTES = 64 * 2**20  # under `auto`, files up to this size are checksummed when a checkpoint is chosen, too
_CHUNK = 16 * 2**20

try:  # not a dependency of olmo-ds: used where installed (wandb brings it)
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None


class CheckpointFileError(ValueError):
    """A checkpoint file that must not or cannot be loaded; `path` names it, `reason` says why (one line)."""

    def __init__(self, path: str | Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason


class UnsafeCheckpointError(CheckpointFileError):
    """The file's pickle asks for something other than tensors and plain data: loading it could run code."""


class DamagedCheckpointError(CheckpointFileError):
    """The file is missing, truncated, of the wrong size or checksum, or not a torch file at all."""


def verify_level() -> str:
    """OLMO_DS_CHECKPOINT_VERIFY: `sizes` (sizes only), `auto` (default: sizes, and checksums of what is
    loaded and of small files when a checkpoint is chosen) or `full` (every checksum before choosing)."""
    level = os.environ.get(VERIFY_ENV, "auto").strip().lower() or "auto"
    if level not in LEVELS:
        raise ValueError(f"{VERIFY_ENV}={level!r}: expected one of {', '.join(LEVELS)}")
    return level


# --- checksums ------------------------------------------------------------------------------------

class _Crc32:
    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def algorithm() -> str:
    """The checksum new manifests record: xxh3_64 where installed, else crc32."""
    return "xxh3_64" if xxhash is not None else "crc32"


def new_hash(name: str | None = None):
    name = name or algorithm()
    if name == "xxh3_64" and xxhash is not None:
        return xxhash.xxh3_64()
    if name == "crc32":
        return _Crc32()
    return None  # a manifest written where xxhash was installed, read where it is not


# Records at least this large are hashed on a thread of their own while the file takes them (see `HashingWriter`).
OVERLAP_BYTES = 64 * 2**20


class HashingWriter:
    """A binary file as `torch.save` sees it: every byte written also goes through the checksum.

    `torch.save` hands each tensor's storage over as one record. A large one is hashed on another thread while
    the same bytes go to the file (both release the GIL), so it costs the slower of the two, not their sum: an
    18 GB optimizer-state file would otherwise add ~1.3 s of xxh3 to a write that the disk bounds. The record is
    hashed completely before `write` returns, because torch may free or reuse the memory behind it right after."""

    def __init__(self, f):
        self.f, self.hash, self.size = f, new_hash(), 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.size += view.nbytes
        if view.nbytes < OVERLAP_BYTES:
            self.hash.update(view)
            return self.f.write(view)
        hasher = threading.Thread(target=self.hash.update, args=(view,), name="olmo_ds-checksum")
        hasher.start()
        try:
            return self.f.write(view)
        finally:
            hasher.join()

    def flush(self) -> None:
        self.f.flush()

    def entry(self) -> dict:
        return {"size": self.size, "checksum": f"{algorithm()}:{self.hash.hexdigest()}"}


def write_torch(obj, path: str | Path) -> dict:
    """`torch.save(obj)` into `path`, hashed on the way and fsynced; the manifest entry of the file."""
    with open(path, "wb") as f:
        writer = HashingWriter(f)
        torch.save(obj, writer)
        f.flush()
        os.fsync(f.fileno())
    return writer.entry()


def entry_of_bytes(data: bytes) -> dict:
    h = new_hash()
    h.update(data)
    return {"size": len(data), "checksum": f"{algorithm()}:{h.hexdigest()}"}


def file_checksum(path: Path, name: str) -> str | None:
    """`path`'s checksum by algorithm `name`, read once in large chunks; None where `name` is unavailable."""
    h = new_hash(name)
    if h is None:
        return None
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return f"{name}:{h.hexdigest()}"


# --- writing the manifest -------------------------------------------------------------------------

def write_part(ckpt_dir: Path, rank: int, files: dict[str, dict]) -> None:
    """This rank's files (name relative to the checkpoint -> entry), once they are on disk."""
    atomic_write_json(Path(ckpt_dir) / PART.format(rank), {"format": FORMAT, "rank": rank, "files": files})


def merge_parts(ckpt_dir: Path, extra: dict[str, dict] | None = None) -> dict:
    """Rank 0, after every rank wrote its part: `manifest.json` (every rank's files and `extra`), written
    atomically; the parts are removed after it. Returns the manifest."""
    ckpt_dir = Path(ckpt_dir)
    files: dict[str, dict] = {}
    parts = sorted(ckpt_dir.glob(PART.format(0).replace("00000", "*")))
    for part in parts:
        files.update(json.loads(part.read_text())["files"])
    files.update(extra or {})
    manifest = {"format": FORMAT, "files": dict(sorted(files.items()))}
    atomic_write_json(ckpt_dir / MANIFEST, manifest)
    for part in parts:
        part.unlink()
    return manifest


def relative_name(path: str | Path, ckpt_dir: Path) -> str:
    return os.path.relpath(path, ckpt_dir)


# --- reading it -----------------------------------------------------------------------------------

_cache_lock = threading.Lock()
_manifests: dict[Path, tuple[int, dict | None]] = {}
_checked: set[tuple[str, int, int]] = set()  # (path, size, mtime) whose checksum matched in this process
_warned: set[str] = set()


def read_manifest(ckpt_dir: str | Path) -> dict | None:
    """A checkpoint's manifest, or None when it has none (written by an earlier olmo-ds)."""
    path = Path(ckpt_dir) / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(text)
        if not isinstance(manifest.get("files"), dict):
            raise ValueError("no 'files' object")
    except ValueError as e:
        raise DamagedCheckpointError(path, f"unreadable ({e}); the checkpoint cannot be checked") from None
    return manifest


def _cached_manifest(ckpt_dir: Path) -> dict | None:
    try:
        mtime = (ckpt_dir / MANIFEST).stat().st_mtime_ns
    except FileNotFoundError:
        mtime = -1
    with _cache_lock:
        hit = _manifests.get(ckpt_dir)
        if hit is not None and hit[0] == mtime:
            return hit[1]
    manifest = read_manifest(ckpt_dir) if mtime != -1 else None
    with _cache_lock:
        _manifests[ckpt_dir] = (mtime, manifest)
    return manifest


def check_entry(path: Path, entry: dict, *, checksum: bool) -> None:
    """`path` has the size `entry` records and, with `checksum`, the checksum; else DamagedCheckpointError."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise DamagedCheckpointError(path, "missing (the manifest lists it)") from None
    if st.st_size != entry["size"]:
        raise DamagedCheckpointError(path, f"{st.st_size:,} bytes, the manifest records {entry['size']:,} "
                                           f"({'truncated or an incomplete copy' if st.st_size < entry['size'] else 'not the file that was saved'})")
    if not checksum:
        return
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _cache_lock:
        if key in _checked:
            return
    name = entry["checksum"].split(":", 1)[0]
    actual = file_checksum(path, name)
    if actual is None:
        if name not in _warned:
            _warned.add(name)
            log.warning("checkpoint manifests record %s checksums, which need the `xxhash` package; "
                        "checking sizes only (pip install xxhash)", name)
        return
    if actual != entry["checksum"]:
        raise DamagedCheckpointError(path, f"checksum {actual} differs from the manifest's {entry['checksum']} "
                                           f"(the bytes changed after the save: a damaged disk or copy)")
    with _cache_lock:
        _checked.add(key)


def check_file(path: Path) -> None:
    """Before a checkpoint file is loaded: its size (always) and checksum (unless OLMO_DS_CHECKPOINT_VERIFY=sizes)
    against the manifest beside it. Files outside any manifest (an earlier version's checkpoint, the universal
    form made at resume) pass unchecked."""
    path = Path(path)
    manifest = _cached_manifest(path.parent)
    if manifest is None:
        return
    entry = manifest["files"].get(path.name)
    if entry is None:
        return
    check_entry(path, entry, checksum=verify_level() != "sizes")
