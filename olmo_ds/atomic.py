"""Files that are either absent (or their old version) or complete, never partial.

Every file another process or a later run trusts — shard metadata, manifests, `train_state.json`,
`latest`, evaluation results — is written through here: to a temporary name beside the target,
fsynced, then renamed over it. A crash at any moment leaves the old file or the new one.
This module imports nothing of olmo_ds, so every layer can use it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` so that `path` is either absent/old or complete, never partial."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_path(path: str | Path) -> None:
    """Flush a file (or a directory's entries) that was written elsewhere, e.g. by torch.save, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())
