"""Where the tests find the shared test data (tokenizers, the C4 sample, eval tasks): one setting; and an
offline Hugging Face cache made from it.

OLMO_DS_SHARED points at the data; by default it is `shared/` beside the repository, as on the
development machines. A GPU host that carries the data inside the checkout sets OLMO_DS_SHARED=$PWD/shared.
Importable by name from any test module (pytest puts tests/ on sys.path for tests/conftest.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("OLMO_DS_SHARED") or ROOT.parent / "shared").resolve()
DOLMA2_HUB_ID = "allenai/dolma2-tokenizer"


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
