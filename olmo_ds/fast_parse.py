"""fastokens parsing a tokenizer.json in a thread of its own, from the first moment a program knows the file.

The parse is the longest step of data preparation's start-up (~0.5 s of CPU for dolma2, three to four times
HF's load) and runs without the GIL, so it can overlap everything else start-up does: importing numpy, the
readers and the tokenizer module (~0.2-0.3 s), loading and hashing the HF reference, checking the output
directory. This module imports only the standard library, so `prepare_data.py` starts the parse before it
imports the pipeline (`olmo_ds.cli.prepare_data`); `olmo_ds.tokenizer.fast_beside(reference, parse=)` waits
for it and wraps the result as the reference's fast encoder.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def single_thread_fast() -> None:
    """fastokens (and the Rayon pool under it) on the calling thread only; set before its first use."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["FASTOKENS_BPE_THREADS"] = "1"


def local_tokenizer_json(spec: str | Path) -> Path | None:
    """The tokenizer.json `spec` names on this disk (the file, or the one in a directory), or None: a hub id, a
    sentencepiece model, a path that does not exist. Without importing anything: `olmo_ds.tokenizer.resolve_path`
    resolves every case, and gives this same path where this gives one."""
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    return path if path.suffix == ".json" and path.is_file() else None


class FastParse:
    """fastokens parsing the tokenizer.json `path` in a daemon thread, started now: a run that stops before it
    needs the encoder (an error, a complete output) does not wait for it."""

    def __init__(self, path: Path, single_thread: bool = True):
        self.path = Path(path)
        self._parsed = self._error = None
        self.thread_id: int | None = None  # the parsing thread's native id, once it runs
        if single_thread:
            single_thread_fast()
        self._thread = threading.Thread(target=self._parse, name="fastokens-parse", daemon=True)
        self._thread.start()

    def _parse(self) -> None:
        self.thread_id = threading.get_native_id()
        try:
            import fastokens

            self._parsed = fastokens.Tokenizer.from_json_str(self.path.read_text(encoding="utf-8"))
        except Exception as e:  # noqa: BLE001 - raised to the caller by `result`
            self._error = e

    def join(self) -> None:
        """Wait until the thread has ended (before forking: a child must not inherit a thread mid-parse)."""
        self._thread.join()

    def result(self):
        """fastokens' tokenizer, once parsed (this waits for it); raises what parsing raised (`ImportError` without
        fastokens). `olmo_ds.tokenizer.fast_beside(reference, parse=self)` wraps it as the reference's fast encoder."""
        self.join()
        if self._error is not None:
            raise self._error
        return self._parsed
