"""Where the tests find the shared test data (tokenizers, the C4 sample, eval tasks): one setting; and an
offline Hugging Face cache made from it.

OLMO_DS_SHARED points at the data; by default it is `shared/` beside the repository, as on the
development machines. A GPU host that carries the data inside the checkout sets OLMO_DS_SHARED=$PWD/shared.
Importable by name from any test module (pytest puts tests/ on sys.path for tests/conftest.py).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("OLMO_DS_SHARED") or ROOT.parent / "shared").resolve()
DOLMA2_HUB_ID = "allenai/dolma2-tokenizer"


def pythonpath(*first: Path | str, drop: tuple[Path, ...] = ()) -> str:
    """PYTHONPATH for a child process: `first`, then the entries this process was given, minus `drop`.
    Hosts whose packages come through PYTHONPATH (HPC module systems, `pip install --target`) keep them."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    dropped = {Path(d).resolve() for d in drop}
    kept = [p for p in inherited if Path(p).resolve() not in dropped]
    return os.pathsep.join(dict.fromkeys([*map(str, first), *kept]))


def deepspeed_launcher() -> str:
    """The `deepspeed` command of this interpreter's environment: beside python in a venv, else on PATH."""
    beside = Path(sys.executable).with_name("deepspeed")
    return str(beside) if beside.exists() else shutil.which("deepspeed") or str(beside)


def fill_hf_cache(cache: Path, repo_id: str, files: dict[str, Path | bytes], commit: str = "0" * 40, ref: str | None = "main",
                  repo_type: str = "model") -> Path:
    """`files` (name in the repo, subfolders allowed -> a local file to copy, or the bytes) laid out as
    `hf download` leaves them in an HF cache: {models,datasets}--ORG--NAME/snapshots/COMMIT/NAME, with
    refs/REF naming the commit (REF may hold slashes: refs/convert/parquet). Returns the snapshot dir."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, src in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(src, bytes):
            (snapshot / name).write_bytes(src)
        else:
            shutil.copyfile(src, snapshot / name)
    snapshot.mkdir(parents=True, exist_ok=True)
    if ref is not None:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
