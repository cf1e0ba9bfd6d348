"""Which library encodes during data preparation: `fastokens` only where it gives HF's exact ids.

Tokenizing with HF `tokenizers` is most of preparation's cost, so an HF tokenizer.json is encoded
with `fastokens` (10-30x faster on one core) once it has given HF's exact ids on a sample of this
input and on `tokenizer.ADVERSARIAL_TEXTS`; otherwise HF encodes, with a warning naming the first
difference. The sample is drawn from the whole input list, so every part of a partitioned run
(`--partition`) decides the same way. The manifest records what ran (`choose`'s record).

The check is three steps, so that the comparison itself (HF encoding ~1 MB, half a second) can run
on the workers (`pipeline._first_difference`) or beside them (`BesideCheck`): `fast_candidate` loads fastokens, `check_texts` says
what to compare on, `choose` decides from the first difference.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

from olmo_ds.data.prepare import readers
from olmo_ds.data.prepare.output import PrepareError
from olmo_ds.fast_parse import FastParse
from olmo_ds.tokenizer import ADVERSARIAL_TEXTS, FastBackendError, fast_beside, first_difference


def guard_sample(files: list[Path], text_field: str, budget: int = 1 << 20) -> tuple[list[str], list[str]]:
    """Documents (and their file:line) from the start of up to 8 input files spread over the input,
    about `budget` characters in all: a document longer than its file's share is cut to that share
    (one line of 50 MB once made the check encode all of it, twice, at once: 26 s and gigabytes)."""
    picks = sorted({round(i * (len(files) - 1) / 7) for i in range(8)}) if len(files) > 8 else range(len(files))
    share = budget // max(len(picks), 1)
    texts, labels = [], []
    for fi in picks:
        first = next(readers.iter_blocks(files[fi], share), None)
        if first is None:
            continue
        first_line, block, _ = first
        left = share
        for line, text, _ in readers.load_block(block, text_field, head=256)[0]:
            if text is not None and left > 0:
                texts.append(text[:left])
                labels.append(f"{files[fi]}:{first_line + line}" + (f" (its first {left:,} characters)" if len(text) > left else ""))
                left -= len(texts[-1])
    return texts, labels


def early_parse(requested: str, path: Path, started: FastParse | None = None) -> FastParse | None:
    """fastokens parsing the tokenizer file `path` in a thread, where `fast_candidate` will want it
    (`FastParse`): the caller loads the HF reference meanwhile. `started`: the parse `prepare_data.py`
    started before its imports (`olmo_ds.cli.prepare_data`), taken if it parses this file."""
    if started is not None and (started.path != path or requested == "hf"):
        started.join()  # not this run's: ended before any worker is forked, then dropped
        started = None
    return None if requested == "hf" or path.suffix == ".model" else started or FastParse(path)


def fast_candidate(requested: str, reference, parse: FastParse | None = None) -> tuple[object | None, str | None]:
    """fastokens over `reference`'s tokenizer.json, to be checked: `(encoder, None)`; or `(None,
    why not)` when it cannot load it; `(None, None)` when there is nothing to check (HF asked for,
    or a sentencepiece model, which has its own encoder). `parse`: `early_parse`'s, if started."""
    if reference.kind == "sentencepiece" or requested == "hf":
        return None, None
    try:
        return fast_beside(reference, parse=parse), None
    except (FastBackendError, ImportError) as e:
        return None, str(e)


def check_texts(files: list[Path], text_field: str) -> tuple[list[str], list[str]]:
    """What fastokens must encode as HF does, with a label for each: `ADVERSARIAL_TEXTS`, then the sample."""
    sample, labels = guard_sample(files, text_field)
    return ADVERSARIAL_TEXTS + sample, [f"adversarial text {i} {t[:24]!r}" for i, t in enumerate(ADVERSARIAL_TEXTS)] + labels


class BesideCheck:
    """The comparison (`check_texts`: fastokens against HF) in a thread of the calling process, while the workers
    tokenize their first files with fastokens: in whole-file mode the coordinating process only hands out files until
    results come back, and both encoders release the GIL, so the check costs the run no time of its own. The caller
    must take `difference()` before anything the workers made is kept (`pipeline._Setup.settle`)."""

    def __init__(self, fast, reference, texts: list[str], labels: list[str]):
        self.fast = fast  # the encoder on trial
        self.checked = len(texts)
        self.seconds = 0.0  # how long the comparison took, beside the tokenizing
        self._found: tuple[str | None, BaseException | None] = (None, None)
        self._thread = threading.Thread(target=self._compare, args=(fast, reference, texts, labels), name="backend-check", daemon=True)
        self._thread.start()

    def _compare(self, fast, reference, texts: list[str], labels: list[str]) -> None:
        t0 = time.perf_counter()
        try:
            self._found = first_difference(fast, reference, texts, labels), None
        except BaseException as e:  # noqa: BLE001 - raised to the caller by `difference`
            self._found = None, e
        self.seconds = time.perf_counter() - t0

    def join(self) -> None:
        """Wait for the thread (a process must not exit while it runs in the encoders: the thread would be stopped inside them)."""
        self._thread.join()

    def difference(self) -> str | None:
        """The first text fastokens encodes otherwise than HF, or None (waits for the thread)."""
        self.join()
        difference, error = self._found
        if error is not None:
            raise error
        return difference


def choose(requested: str, reference, fast, difference: str | None, checked: int, log: Callable[[str], None]) -> tuple[object, dict]:
    """The encoder to use and what the manifest records about it. `fast`: `fast_candidate`'s encoder;
    `difference`: the first text it encoded otherwise than HF (or why it could not load), None if none.

    `fast` is used only when there is no difference; otherwise `auto` falls back to HF with a warning
    naming the difference and `fast` stops.
    """
    if reference.kind == "sentencepiece":
        return reference, {"name": "sentencepiece", "version": version("sentencepiece"), "requested": requested}
    hf = {"name": "tokenizers", "version": version("tokenizers"), "requested": requested}
    if requested == "hf":
        return reference, hf
    if fast is not None and difference is None:
        return fast, {"name": "fastokens", "version": version("fastokens"), "requested": requested, "checked_against_hf": checked}
    if requested == "fast":
        raise PrepareError(f"--tokenizer-backend fast: fastokens does not match HF tokenizers: {difference}; use --tokenizer-backend hf (or auto)")
    log(f"warning: fastokens does not match HF tokenizers ({difference}); falling back to HF tokenizers (exact, slower)")
    return reference, {**hf, "fallback_reason": difference}


def version(package: str) -> str:
    from importlib.metadata import version as installed

    return installed(package)
