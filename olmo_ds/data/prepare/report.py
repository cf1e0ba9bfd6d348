"""What data preparation tells the user: skipped records with `file:line` examples, per-file counts,
progress while it runs, and the summary at the end."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from olmo_ds.data.validate import Report

MAX_EXAMPLES = 5  # file:line examples kept per reason


@dataclass
class SkipLog:
    """Records by reason (skipped, or noted), with the first few `file:line` examples of each."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < MAX_EXAMPLES:
            ex.append(where)

    def copy(self) -> "SkipLog":
        return SkipLog(dict(self.counts), {k: list(v) for k, v in self.examples.items()})

    def to_dict(self) -> dict:
        return {"counts": dict(sorted(self.counts.items())), "examples": dict(sorted(self.examples.items()))}

    @classmethod
    def from_dict(cls, d: dict) -> "SkipLog":
        return cls(dict(d["counts"]), {k: list(v) for k, v in d["examples"].items()})

    def extend(self, later: "SkipLog") -> None:
        """Append the log of the input that follows this one's (a later part of a partitioned run):
        counts add up, and the examples stay the first few in input order."""
        for reason, n in later.counts.items():
            self.counts[reason] = self.counts.get(reason, 0) + n
            self.examples[reason] = (self.examples.get(reason, []) + later.examples.get(reason, []))[:MAX_EXAMPLES]


@dataclass
class FileStats:
    path: str
    bytes: int
    docs: int = 0
    tokens: int = 0
    skipped: int = 0


@dataclass
class PrepareResult:
    output: Path | None
    files: list[FileStats]
    num_docs: int
    num_tokens: int
    val_docs: int
    val_tokens: int
    num_shards: int
    skipped: SkipLog
    seconds: float
    text_bytes: int  # decompressed input read by this run
    run_tokens: int  # tokens produced by this run (less than the totals after a resume)
    resumed_from: str | None = None
    noted: SkipLog = field(default_factory=SkipLog)  # documents kept but worth knowing about (special-token text)
    already_complete: bool = False
    backend: str = ""  # the library that encoded: fastokens, tokenizers or sentencepiece
    layout: str = ""  # who tokenized (`pool_layout`), for the summary
    check_seconds: float = 0.0  # the fast backend's check against HF (`backend`), 0 when there was none
    check_beside: bool = False  # that check ran beside the tokenizing (whole files, `backend.BesideCheck`): no time of its own
    total_seconds: float = 0.0  # the whole of `prepare`, from checking the inputs to the last manifest
    run_docs: int = 0  # documents written by this run (less than the totals after a resume)
    conversations: bool = False  # `--format chat`: the documents are conversations (the summary says conversations/s)
    pairs: bool = False  # `--format preference`: documents 2i, 2i + 1 are a pair (the summary counts pairs too)
    prompts: bool = False  # `--format rl`: the documents are prompts (the summary says prompts, and prompts/s)
    phases: dict[str, float] = field(default_factory=dict)  # wall seconds of each step of `prepare`, in order (`Phases`)
    validation: Report | None = None  # the final validation's `validate.Report` (None: a dry run, or output already complete)


class Phases:
    """Wall seconds of each step of a run, in order, one clock from start to end: where start-up
    goes (inputs, tokenizer, workers, the backend check) is what decides a short run's speed-up on
    many cores, so the summary shows it and `bench_prepare.py` reads it back."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.last = time.perf_counter()

    def mark(self, step: str) -> None:
        """`step` ended now: it took the time since the previous mark (added to an earlier same-named step)."""
        now = time.perf_counter()
        self.seconds[step] = self.seconds.get(step, 0.0) + now - self.last
        self.last = now


def _pairs(r: PrepareResult, docs: int) -> str:
    return f" ({docs // 2:,} preference pairs)" if r.pairs else " (RL prompts)" if r.prompts else ""


class Progress:
    """Progress of one run (or one part): a tqdm bar on a terminal; where stderr is not one (the log
    of a Slurm job) a plain line every `every` seconds and one at the end, with the share of input
    bytes done, tokens/s and the ETA. Rates count this run only, so a resumed run is not flattered
    by the work done before it. `enabled`: None chooses by the terminal, True forces the bar,
    False shows nothing."""

    def __init__(self, total: int, done: int, enabled: bool | None, label: str = "prepare", every: float = 60.0, stream=None):
        self.stream = stream or sys.stderr
        self.total, self.start_done, self.done, self.label, self.every = total, done, done, label, every
        self.t0 = self.last = time.perf_counter()
        self.docs = self.tokens = self.text_bytes = 0
        self.bar = None
        self.lines = enabled is None and not self.stream.isatty()
        if enabled or (enabled is None and not self.lines):
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, unit="B", unit_scale=True, unit_divisor=1024, desc=label, file=self.stream, dynamic_ncols=True)

    def update(self, done: int, docs: int, tokens: int, text_bytes: int) -> None:
        """`done`: input bytes on disk behind us; the rest: this block's counts."""
        self.docs, self.tokens, self.text_bytes = self.docs + docs, self.tokens + tokens, self.text_bytes + text_bytes
        if self.bar is not None:
            self.bar.update(done - self.done)
            dt = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{self.docs / dt:,.0f} docs/s, {self.tokens / dt / 1e6:,.2f}M tok/s, {self.text_bytes / dt / 1e6:,.1f} MB/s text", refresh=False)
        self.done = done
        if self.lines and time.perf_counter() - self.last >= self.every:
            self._line()

    def _line(self, final: bool = False) -> None:
        self.last = now = time.perf_counter()
        dt = max(now - self.t0, 1e-9)
        pct = 100.0 * self.done / self.total if self.total else 100.0
        rate = (self.done - self.start_done) / dt
        eta = "done" if final else (_clock((self.total - self.done) / rate) if rate > 0 else "unknown")
        print(f"{self.label}: {pct:5.1f}% of {self.total / 1e9:,.2f} GB, {self.tokens:,} tokens in {_clock(dt)}, "
              f"{self.tokens / dt / 1e6:,.2f}M tokens/s, {self.text_bytes / dt / 1e6:,.1f} MB/s of text, ETA {eta}", file=self.stream, flush=True)

    def close(self, finished: bool) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.lines and finished:
            self._line(final=True)


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def log_file(log: Callable[[str], None], s: FileStats) -> None:
    log(f"{s.path}: {s.docs:,} docs, {s.tokens:,} tokens, {s.skipped:,} skipped")


def format_summary(r: PrepareResult, dry_run: bool = False) -> str:
    """The table printed at the end of a run."""
    rows = []
    if dry_run:
        rows.append(("file", "docs", "tokens", "skipped"))
        rows += [(s.path, f"{s.docs:,}", f"{s.tokens:,}", f"{s.skipped:,}") for s in r.files]
        width = max(len(a) for a, *_ in rows)
        lines = [f"{a:<{width}}  {b:>12}  {c:>14}  {d:>8}" for a, b, c, d in rows]
        lines.append(f"{'total':<{width}}  {r.num_docs:>12,}  {r.num_tokens:>14,}  {sum(r.skipped.counts.values()):>8,}")
        lines.append("dry run: nothing written")
    else:
        lines = [f"output          {r.output}"]
        if r.resumed_from:
            lines.append(f"resumed from    {r.resumed_from}")
        lines += [
            f"input files     {len(r.files):,} ({sum(s.bytes for s in r.files) / 1e6:,.1f} MB on disk)",
            f"train           {r.num_docs:,} docs{_pairs(r, r.num_docs)}, {r.num_tokens:,} tokens",
        ]
        if r.val_docs or r.val_tokens:
            lines.append(f"val             {r.val_docs:,} docs{_pairs(r, r.val_docs)}, {r.val_tokens:,} tokens")
        lines.append(f"shards          {r.num_shards:,}")
        if r.validation is not None:
            v = r.validation
            lines.append(f"validated       {'OK' if v.ok else 'FAIL'}: {len(v.shards):,} shards, {v.from_checks:,} as checked by the process that wrote "
                         f"each, {len(v.shards) - v.from_checks:,} read again (scripts/validate_shards.py DIR reads them all)")
    lines.append(f"tokenizer       {r.backend}" + (f", run by {r.layout}" if r.layout else ""))
    lines.append(f"skipped         {sum(r.skipped.counts.values()):,} records")
    for reason, n in sorted(r.skipped.counts.items()):
        lines.append(f"  {reason:<22}{n:>10,}   e.g. {', '.join(r.skipped.examples.get(reason, [])[:3])}")
    for reason, n in sorted(r.noted.counts.items()):
        lines.append(f"noted           {n:,} documents with {reason.replace('_', ' ')}   e.g. {', '.join(r.noted.examples.get(reason, [])[:3])}")
    if r.total_seconds > 0:
        # All of the run: the tokenizing loop alone once left out a 26 s backend check.
        alone = r.check_seconds if not r.check_beside else 0.0  # a check beside the tokenizing is inside its time
        rest = max(r.total_seconds - alone - r.seconds, 0.0)
        lines.append(f"time            {r.total_seconds:,.3f} s in all")
        if alone:
            lines.append(f"  backend check {r.check_seconds:>10,.3f} s  ({r.backend} against HF tokenizers before any shard, `--tokenizer-backend hf` skips it)")
        if r.seconds > 0:
            per_s = f"{r.run_docs / r.seconds:,.0f} {'prompts' if r.prompts else 'conversations'}/s, " if r.conversations else ""
            lines.append(f"  tokenizing    {r.seconds:>10,.3f} s  (reading, tokenizing, writing: {per_s}{r.run_tokens / r.seconds / 1e6:,.2f}M tokens/s, {r.text_bytes / r.seconds / 1e6:,.1f} MB/s of text)")
        if r.check_beside:
            lines.append(f"    of which the backend check {r.check_seconds:,.3f} s  ({r.backend} against HF tokenizers in this process while the workers "
                         f"tokenized the first files; nothing was kept before it passed)")
        lines.append(f"  the rest      {rest:>10,.3f} s  (checking inputs and output, loading the tokenizer, starting workers, manifests, validating)")
        own = {"backend": alone > 0, "tokenizing": r.seconds > 0}  # the steps shown on lines of their own above
        lines += [f"    {step:<12}{seconds:>10,.3f} s" for step, seconds in r.phases.items() if not own.get(step)]
    return "\n".join(lines)
