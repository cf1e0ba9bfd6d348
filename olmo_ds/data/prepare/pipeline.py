"""Raw text → token shards (see `olmo_ds/data/shards.py` for the format), exact and restartable.

The promise users rely on: without a validation split, the concatenation of `DIR/shard-*.bin` in
name order is exactly the input documents' ids in input order (files sorted, lines in file order),
each followed by EOS, whatever the number of workers. Hence the design:

- Blocks (`--work-unit blocks`; `work_unit` picks): the main process hands out blocks of whole
  lines; a pool of worker processes reads (uncompressed files: each worker reads its own byte
  range, `readers.iter_ranges`), parses JSON and tokenizes them (`pool_layout`: N workers are N
  processes when a core is spare for the main process, otherwise N - 1 and the main process
  tokenizes whenever it would wait). Compressed streams can only be decompressed in order, so the
  main process reads and cuts those (`readers.iter_chunks`). Workers number lines within their
  block and the main process, which sees blocks in input order, turns them into file lines;
  results come back in submission order, so output order is input order for any worker count. At
  most `2 × workers` blocks are in flight, so memory is bounded by the block size, never by the
  corpus or a file. The main process writes and hashes every shard.
- Whole files (`--work-unit files`, the choice with many input files): each worker takes whole
  files, decompression included, and writes their ids to pieces; the main process cuts the pieces
  into the same shards in input order and workers write them (`pieces`). Same bytes.
- Shards are streamed to temporary files and renamed when complete, metadata last
  (`shards.ShardWriter`). Each shard's metadata records the input position just after its last
  document (`next_record`) and the skip counts up to there, so a rerun after a kill resumes from
  the last complete shard and produces byte-identical output (`output`).
- A validation split (`val_fraction`) is chosen by a hash of each document's text: the same for
  any worker count or resume point, and duplicates of a document always land in the same split.
- An HF tokenizer.json is encoded with `fastokens` only where it gives HF's exact ids
  (`backend`); what the user reads while and after it runs is `report`.

- Conversations (`format="chat"`, `conversations`): each record's `messages` rendered with a chat
  template into one document ending in its EOS, with a loss mask that travels beside the ids
  through every writer above (blocks, pieces, the partition merge) into masked shards.
- RL prompts (`format="rl"`, `prompts`): each record's `messages` rendered with the generation prompt
  appended into one document (no EOS, no mask), its verifier and ground truth (checked by the caller's
  `check_ground_truth`) one line of the shard's sidecar, in document order; blocks only (no whole-file
  mode, no partitions: prompt sets are small).
- Preference pairs (`format="preference"`, `preferences`): each record's `chosen` and `rejected`
  conversations rendered so, each masked to its final reply, as two adjacent documents of one input
  position; the writers cut shards only between pairs (`shards.ShardCutter.feed_pairs`). A pair longer
  than `max_tokens` stops the run here (`long_pairs="refuse"`) or is skipped (`drop`).

This module is the coordinating process; what a worker process does (parse, tokenize, check the
fast backend) is `worker`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import json
import shutil
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

import olmo_ds
from olmo_ds.atomic import atomic_write_json
from olmo_ds.chat import MASKS, ChatEncoder, load_chat_template, require_template_tokens
from olmo_ds.data import shards
from olmo_ds.data.packing import LONG_PAIRS
from olmo_ds.data.validate import ShardRules, check_path, check_shard, inner_eos_reason, split_rules, validate_directory
from olmo_ds.data.prepare import partition, readers
from olmo_ds.data.prepare.backend import BesideCheck, check_texts, choose, early_parse, fast_candidate
from olmo_ds.data.prepare.conversations import LONG_CONVERSATIONS, POLICY_REASONS, TOO_LONG, template_sha256
from olmo_ds.data.prepare.prompts import with_source
from olmo_ds.data.prepare.output import (
    STATE_FILE,
    VAL_DIR,
    PrepareError,
    SplitWriter,
    check_output,
    identity,
    our_files,
    position,
    split_position,
    where_to_resume,
)
from olmo_ds.data.prepare.pieces import (
    PIECES_DIR,
    Assembly,
    PieceResult,
    Pieces,
    PieceSplit,
    ShardJob,
    Task,
    plan_tasks,
)
from olmo_ds.data.prepare.pool import OrderedPool, TaskPool
from olmo_ds.data.prepare.report import (
    FileStats,
    Phases,
    PrepareResult,
    Progress,
    SkipLog,
    log_file,
)
from olmo_ds.data.prepare.worker import (
    ALL_LINES,
    CheckSlice,
    ChunkResult,
    Spec,
    check_slice,
    chunk_in_worker,
    files_worker,
    loaded_tokenizers,
    process_chunk,
    special_token_texts,
    train_lines_done,
)
from olmo_ds.fast_parse import FastParse
from olmo_ds.tokenizer import load_tokenizer, resolve_path


@dataclass
class PrepareConfig:
    inputs: list[str]
    output: Path
    tokenizer: str
    text_field: str = "text"
    workers: int = 1
    shard_tokens: int = 100_000_000
    val_fraction: float = 0.0
    eos_token: str | None = None
    dry_run: bool = False
    verbose: bool = False
    strict: bool = False
    overwrite: bool = False
    tokenizer_backend: str = "auto"  # "auto" | "fast" | "hf"; see backend.py
    chunk_bytes: int = readers.CHUNK_BYTES
    progress: bool | None = None  # None: a bar when stderr is a terminal, else plain lines (report.Progress)
    progress_every: float = 60.0  # seconds between plain progress lines
    # False (default): special-token text inside a document ("<|endoftext|>" quoted on a web page)
    # is encoded as ordinary text, so EOS ids only ever end documents. True: matched as the special
    # token, as HF tokenizers does by default and olmo-ds did before (EOS ids inside documents).
    match_special_tokens: bool = False
    # (I, M): prepare only part I of M (0-based) of the sorted input list, cut into M contiguous
    # ranges of about equal bytes; `scripts/merge_shards.py` joins the M part directories.
    partition: tuple[int, int] | None = None
    # What a worker takes: "files" (whole files, decompression included; shards cut from the
    # workers' pieces, `pieces`), "blocks" (~1 MiB blocks handed out by this process, which
    # decompresses compressed files itself), or "auto": files when there are many (`work_unit`).
    work_unit: str = "auto"
    # "text" (documents), "chat" (conversations → masked shards, `conversations`) or "preference" (pairs of
    # conversations → preference shards, `preferences`). The chat and pair options are None unless given,
    # so that one given with a format it means nothing for can be refused by name.
    format: str = "text"
    chat_template: str | None = None  # built-in name, tokenizer_config.json, directory or Jinja file; None: the one beside the tokenizer
    chat_mask: str | None = None  # "assistant" (default) | "all" | "last"
    max_tokens: int | None = None
    long_conversations: str | None = None  # "drop" (default) | "truncate"
    long_pairs: str | None = None  # "refuse" (default) | "drop": a pair longer than max_tokens (both sides) stops the run or is skipped
    # format "rl": (verifier, ground_truth) -> the verifier's name, or a ValueError (`prompts`); evaluation's
    # `olmo_ds.eval.verifiers.check`, passed in by the caller because data preparation may not import evaluation
    check_ground_truth: Callable | None = None
    allow_split_template_tokens: bool = False  # prepare even if the tokenizer lacks the template's markers (`chat.require_template_tokens`)
    _chat: dict | None = dataclasses.field(default=None, repr=False)  # settled by `_resolve_chat` before any work

    def validate(self) -> None:
        self._validate_format()
        if self.workers < 1:
            raise PrepareError(f"--workers must be >= 1, got {self.workers}")
        if self.shard_tokens < 1:
            raise PrepareError(f"--shard-tokens must be >= 1, got {self.shard_tokens}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise PrepareError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.tokenizer_backend not in ("auto", "fast", "hf"):
            raise PrepareError(f"--tokenizer-backend must be auto, fast or hf, got {self.tokenizer_backend!r}")
        if self.work_unit not in ("auto", "files", "blocks"):
            raise PrepareError(f"--work-unit must be auto, files or blocks, got {self.work_unit!r}")
        if not self.text_field:
            raise PrepareError("--text-field must not be empty")
        if self.progress_every < 0:
            raise PrepareError(f"--progress-every must be >= 0 seconds, got {self.progress_every}")
        if self.partition is not None:
            i, m = self.partition
            if not (m >= 1 and 0 <= i < m):
                raise PrepareError(f"--partition {i}/{m}: expected I/M with 0 <= I < M")

    def _validate_rl(self) -> None:
        if self.check_ground_truth is None:
            raise PrepareError("--format rl needs a ground-truth check (check_ground_truth: prepare_data.py passes olmo_ds.eval.verifiers.check)")
        for flag, value in (("--mask", self.chat_mask), ("--long-conversations", self.long_conversations)):
            if value is not None:
                raise PrepareError(f"{flag}: --format rl writes prompts, which train no token and are never cut (--max-tokens refuses longer ones)")
        if self.partition is not None:
            raise PrepareError("--partition: --format rl prepares a prompt set in one run (its shards' ground-truth sidecars are not merged)")
        if self.work_unit == "files":
            raise PrepareError("--work-unit files: --format rl reads blocks (use auto or blocks)")

    def _validate_format(self) -> None:
        if self.format not in ("text", "chat", "preference", "rl"):
            raise PrepareError(f"--format must be text, chat, preference or rl, got {self.format!r}")
        if self.format == "rl":
            self._validate_rl()
        given = {"--chat-template": self.chat_template, "--mask": self.chat_mask, "--max-tokens": self.max_tokens,
                 "--long-conversations": self.long_conversations, "--allow-split-template-tokens": self.allow_split_template_tokens or None}
        if self.long_pairs is not None and self.format != "preference":
            raise PrepareError(f"--long-pairs is for preference pairs: it needs --format preference (this run prepares {self.format} data)")
        if self.format == "text":
            for flag, value in given.items():
                if value is not None:
                    also = " or --format preference" if flag in ("--chat-template", "--max-tokens", "--allow-split-template-tokens") else ""
                    raise PrepareError(f"{flag} is for conversations: it needs --format chat{also} (this run prepares text documents)")
            return
        what = "each record's 'chosen' and 'rejected' lists" if self.format == "preference" else "each record's 'messages' list"
        if self.text_field != "text":
            raise PrepareError(f"--text-field {self.text_field!r}: --format {self.format} reads {what}, not a text field")
        if self.eos_token is not None:
            raise PrepareError(f"--eos-token: --format {self.format} ends each conversation with the chat template's own EOS, appends none")
        if self.match_special_tokens:
            raise PrepareError(f"--match-special-tokens: with --format {self.format} only the template's own markers become special ids; "
                               "special-token text inside content always stays text")
        if self.tokenizer_backend == "fast":
            raise PrepareError(f"--tokenizer-backend fast: --format {self.format} encodes with HF tokenizers (it needs their offsets); use auto or hf")
        if self.format == "preference":
            if self.chat_mask is not None:
                raise PrepareError("--mask: --format preference trains each side's final assistant reply only (--mask is for --format chat)")
            if self.long_conversations is not None:
                raise PrepareError("--long-conversations: a pair is never cut (its replies are what is compared); with --format preference "
                                   "--long-pairs refuse|drop says what a pair longer than --max-tokens does")
            if self.long_pairs is not None and self.long_pairs not in LONG_PAIRS:
                raise PrepareError(f"--long-pairs must be one of {', '.join(LONG_PAIRS)}, got {self.long_pairs!r}")
            if self.long_pairs is not None and self.max_tokens is None:
                raise PrepareError("--long-pairs needs --max-tokens N (the length of a pair, both sides together, that is refused or dropped)")
        if self.chat_mask is not None and self.chat_mask not in MASKS:
            raise PrepareError(f"--mask must be one of {', '.join(MASKS)}, got {self.chat_mask!r}")
        if self.long_conversations is not None and self.long_conversations not in LONG_CONVERSATIONS:
            raise PrepareError(f"--long-conversations must be one of {', '.join(LONG_CONVERSATIONS)}, got {self.long_conversations!r}")
        if self.long_conversations is not None and self.max_tokens is None:
            raise PrepareError("--long-conversations needs --max-tokens N (the length a conversation is dropped or truncated at)")
        if self.max_tokens is not None and self.max_tokens < 2:
            raise PrepareError(f"--max-tokens must be >= 2, got {self.max_tokens}")


def _single_threaded() -> None:
    # One process per core: tokenizer libraries must not start threads of their own.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"


def _thread_count(ignore: int | None = None) -> int | None:
    """This process's threads, but `ignore` (a native thread id: one that has ended, which the
    system may list for a moment after `join`)."""
    try:
        return len([t for t in os.listdir("/proc/self/task") if t != str(ignore)])
    except OSError:  # no /proc: not Linux
        return None


def _start_method(threads_before: int | None, ended: int | None = None) -> str:
    """fork, so that workers inherit the loaded and checked tokenizer for free, unless loading or
    running it started threads (a library's thread pool would be inherited without its threads):
    then the workers are spawned and load the tokenizer themselves. `ended`: the thread that
    parsed the fast encoder (`backend.early_parse`), joined but maybe not yet gone."""
    now = _thread_count(ended)
    return "fork" if now is not None and threads_before is not None and now <= threads_before else "spawn"


def _first_difference(workers: _Workers, texts: list[str], labels: list[str]) -> str | None:
    """The backend check spread over the block workers (whole files check it beside their first files,
    `BesideCheck`): HF encodes ~1 MB in it, half a second on one core. The texts are cut into one
    contiguous slice per process, of about equal length, so the first difference in slice order is the
    one a single process would report."""
    pool = workers.pool
    n = len(pool.procs) if pool else 1
    ends = np.cumsum([len(t) for t in texts])
    cuts = [0, *np.searchsorted(ends, ends[-1] * np.arange(1, n) / n).tolist(), len(texts)]
    parts = [CheckSlice(tuple(texts[a:b]), tuple(labels[a:b])) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
    if pool is None:
        found = [check_slice(workers.spec, part) for part in parts]
    else:
        found = [header for header, _ in pool.imap([(part,) for part in parts], work_here=workers.work_here)]
    return next((d for d in found if d is not None), None)


def _ordered_results(tasks: Iterator[tuple], workers: _Workers) -> Iterator[tuple]:
    """Yield `(extra, ChunkResult)` for each `(extra, task_args)` in input order.

    Without a pool the blocks are tokenized here (one worker is one core: this one). With one, at
    most two blocks per worker are in flight, so memory does not depend on the input's size; with
    `work_here` this process tokenizes too whenever the next result is not ready (`pool_layout`).
    """
    pool = workers.pool
    if pool is None:
        for extra, args in tasks:
            yield extra, process_chunk(workers.spec, *args)
        return
    extras: deque = deque()

    def args_only():
        for extra, args in tasks:
            extras.append(extra)
            yield args

    for res, tokens in pool.imap(args_only(), work_here=workers.work_here):
        res.tokens = tokens
        yield extras.popleft(), res


def _tasks(files: list[Path], start: int, end_file: int, chunk_bytes: int, train_from: int) -> Iterator[tuple]:
    """`((file index, first line or None, disk bytes done), worker arguments)` for each block from
    input position `start` to the end of file `end_file - 1` (see `readers.iter_blocks`), with the
    block's lines whose train documents are in complete shards, the train split resuming at
    `train_from` (`worker.process_chunk`). A byte range of the file where the train split resumes
    is cut there, so that each range is wholly before or after it: its first line is not known
    here (the lines of the ranges before it are counted as their results come back)."""
    start_file, start_line = split_position(start)
    train_file, train_line = split_position(train_from)
    for fi in range(start_file, end_file):
        blocks = readers.iter_blocks(files[fi], chunk_bytes, max(start_line, 1) if fi == start_file else 1)
        cut = readers.line_offset(files[fi], train_line) if fi == train_file and train_from > start else None
        for first_line, block, done in blocks:
            if first_line is not None:
                yield (fi, first_line, done), (fi, block, train_lines_done(fi, first_line, train_from))
                continue
            if cut is not None and block.start < cut < block.end:
                yield (fi, None, done), (fi, dataclasses.replace(block, end=cut), ALL_LINES)
                block = dataclasses.replace(block, start=cut)
            before = fi < train_file or (cut is not None and block.end <= cut)
            yield (fi, None, done), (fi, block, ALL_LINES if before else 0)



SPECIAL_TEXT = "special_token_text"  # the reason under which documents holding special-token text are noted


def _settings(cfg: PrepareConfig) -> dict:
    """The arguments that change the output's bytes (part of the resume identity). Matching
    special tokens adds no key: directories started before the option existed did that, and resume
    with --match-special-tokens."""
    settings = {"text_field": cfg.text_field, "shard_tokens": cfg.shard_tokens, "val_fraction": cfg.val_fraction}
    if cfg.partition is not None:
        settings["partition"] = list(cfg.partition)
    if cfg.format in ("chat", "preference", "rl"):
        # The template by content, wherever it lies. `long_pairs` is not here: `refuse` stops at the first long
        # pair, so the shards it completed are those `drop` writes, and a rerun with `drop` resumes them.
        settings["chat"] = {k: v for k, v in _chat_record(cfg).items() if k != "template"}
    if cfg.format in ("preference", "rl"):  # else a chat run with --mask last would share its identity (chat's own keys stay as they were)
        settings["format"] = cfg.format
    if cfg.format == "rl":
        check = cfg.check_ground_truth
        settings["check_ground_truth"] = f"{getattr(check, '__module__', '')}.{getattr(check, '__qualname__', type(check).__name__)}"
    return settings if cfg.match_special_tokens else settings | {"special_tokens": "as_text"}


def _chat_record(cfg: PrepareConfig) -> dict:
    """What a run of conversations records (in its resume identity and its manifest): the template
    and its fingerprint, the mask, the length rule. Set by `_resolve_chat`."""
    return dict(cfg._chat)


def _pair_length(cfg: PrepareConfig) -> dict:
    """What a run of preference pairs records beside `_chat_record`: the length rule of a pair (both sides together)."""
    return {"max_tokens": cfg.max_tokens, "long_pairs": (cfg.long_pairs or "refuse") if cfg.max_tokens else None}


def _resolve_chat(cfg: PrepareConfig, tok) -> object:
    """Load the chat template (checked against the tokenizer before any work) and settle the chat
    options; returns the template."""
    spec = cfg.chat_template
    if spec is None:
        beside = Path(tok.path).parent / "tokenizer_config.json"
        if not (beside.is_file() and "chat_template" in json.loads(beside.read_text(encoding="utf-8"))):
            raise PrepareError(f"--format {cfg.format} needs a chat template and {tok.path} has no tokenizer_config.json with a 'chat_template' beside it; "
                               "pass --chat-template olmo3 (OLMo 3's, built in), a tokenizer_config.json, a directory or a Jinja file")
        spec = str(beside)
    elif Path(spec).exists():
        spec = str(Path(spec).resolve())
    pairs, prompts = cfg.format == "preference", cfg.format == "rl"
    mask = "last" if pairs else cfg.chat_mask or "assistant"  # a pair's side trains its final reply only; a prompt trains nothing
    try:
        template = load_chat_template(spec, tok)
        split = require_template_tokens(ChatEncoder(template, tok, mask=mask), allow_split=cfg.allow_split_template_tokens)
    except (OSError, ValueError) as e:
        raise PrepareError(f"--chat-template {cfg.chat_template or spec}: {e}") from e
    cfg._chat = {"template": spec, "template_sha256": template_sha256(template), "template_tokens": dict(template.tokens),
                 "mask": mask, "max_tokens": cfg.max_tokens,
                 "long_conversations": (cfg.long_conversations or "drop") if cfg.max_tokens and not (pairs or prompts) else None,
                 "special_token_text": "escape", **({"split_template_tokens": split} if split else {})}  # only then: earlier directories keep their identity
    if prompts:
        cfg._chat.update(mask=None, generation_prompt=True)
    return template


def prepare(cfg: PrepareConfig, log: Callable[[str], None] = print, parse: FastParse | None = None) -> PrepareResult:
    """Run data preparation; see the module docstring. Raises `PrepareError` for bad input or output.
    `parse`: fastokens already parsing the tokenizer.json (`prepare_data.py` starts it before its imports)."""
    clock = Phases()  # the summary's time covers all of it, step by step (`report.format_summary`)
    cfg.validate()
    try:
        files = readers.resolve_inputs(list(cfg.inputs))
        for f in files:
            if cfg.format == "rl" and not f.name.endswith(readers.JSONL_SUFFIXES):
                raise ValueError(f"{f}: --format rl reads JSON lines (.jsonl, optionally compressed), one RLVR row per line")
            readers.check_input(f, cfg.text_field, chat=cfg.format == "chat", preference=cfg.format == "preference")
        lo, hi = partition.file_range(files, cfg.partition) if cfg.partition else (0, len(files))
    except (OSError, ValueError) as e:
        raise PrepareError(str(e)) from e
    if all(f.stat().st_size == 0 for f in files):
        raise PrepareError(f"no documents to prepare: every input file is empty (0 bytes): {_some(files)}; nothing was written")
    clock.mark("inputs")
    chat = cfg.format in ("chat", "preference", "rl")
    _single_threaded()
    threads_before = _thread_count()
    try:
        path = resolve_path(cfg.tokenizer)
        parse = early_parse("hf" if chat else cfg.tokenizer_backend, path, parse)  # fastokens parses while HF loads
        tok = load_tokenizer(path, cfg.eos_token)
    except (OSError, ValueError) as e:
        raise PrepareError(str(e)) from e
    tok.split_special_tokens = not cfg.match_special_tokens
    if chat:
        if tok.kind != "hf":
            raise PrepareError(f"--tokenizer {cfg.tokenizer}: --format {cfg.format} needs an HF tokenizer.json (its special tokens and offsets), not a {tok.kind} model")
        _resolve_chat(cfg, tok)
    clock.mark("tokenizer")
    out = Path(cfg.output)
    ident = identity(tok, files, _settings(cfg))
    file_stats = [FileStats(str(f), f.stat().st_size) for f in files[lo:hi]]
    mode = "fresh" if cfg.dry_run else check_output(out, ident, cfg.overwrite, tok)
    clock.mark("output")
    if mode == "complete":
        m = shards.Manifest.load(out)
        log(f"{out}: already complete ({m.num_docs} documents, {m.num_tokens} tokens in {len(m.shards)} shards); nothing to do")
        return PrepareResult(out, file_stats, m.num_docs, m.num_tokens, 0, 0, len(m.shards), SkipLog.from_dict(m.extra["skipped"]), 0.0, 0, 0,
                             noted=SkipLog.from_dict(m.extra.get("noted", SkipLog().to_dict())), already_complete=True)

    fast, difference = fast_candidate(cfg.tokenizer_backend, tok, parse) if not chat else (None, None)
    spec = Spec(str(cfg.tokenizer), cfg.eos_token, "fast" if fast else "hf", cfg.text_field, cfg.val_fraction,
                not cfg.match_special_tokens, special_token_texts(tok))
    if chat:
        c = cfg._chat
        spec = dataclasses.replace(spec, format=cfg.format, chat_template=c["template"], chat_mask=c["mask"] or "assistant", max_tokens=c["max_tokens"],
                                   long_conversations=c["long_conversations"] or "drop", check_ground_truth=cfg.check_ground_truth)
    loaded_tokenizers[spec] = fast or tok
    loaded_tokenizers[dataclasses.replace(spec, backend="hf")] = tok  # the check's reference; forked workers inherit both
    unit = "blocks" if cfg.format == "rl" else work_unit(cfg.work_unit, cfg.workers, hi - lo)  # RL prompts: blocks only (`_validate_rl`)
    context = mp.get_context(_start_method(threads_before, parse.thread_id if parse else None))
    clock.mark("fast backend")

    with contextlib.ExitStack() as stack:
        # The workers start before fastokens is trusted, so that they can check it (blocks), or tokenize their first
        # files while this process checks it (whole files, `BesideCheck`): a fallback to HF starts workers anew.
        workers = _Workers.start(stack, unit, cfg.workers, spec, context)
        clock.mark("workers")
        setup = _Setup(cfg, files, (lo, hi), tok, ident, file_stats, None, log, clock)
        if fast is not None and workers.unit == "files":
            setup.beside = BesideCheck(fast, tok, *check_texts(files, cfg.text_field))
        else:
            texts = []
            if fast is not None:
                texts, labels = check_texts(files, cfg.text_field)
                difference = _first_difference(workers, texts, labels)
            encoder, setup.backend = choose("hf" if chat else cfg.tokenizer_backend, tok, fast, difference, len(texts), log)
            if fast is not None and encoder is not fast:
                workers = _restart_with_hf(stack, workers, cfg.workers, context)
        clock.mark("backend")  # choosing it: the check, when there is one
        check_seconds = clock.seconds["backend"] if fast is not None else 0.0
        if mode == "overwrite":
            for p in our_files(out):
                p.unlink()
        if setup.beside is not None:
            stack.callback(setup.beside.join)  # an error before its verdict: the thread ends before this process does
        created = not out.exists()
        try:
            result = _run(setup, workers)
        except _FellBack:  # the beside-check found a difference before anything was kept: again with HF
            workers = _restart_with_hf(stack, workers, cfg.workers, context)
            result = _run(setup, workers)
        except PrepareError:
            if setup.backend is None and not cfg.dry_run:  # stopped before the backend's verdict (`--tokenizer-backend fast` refused)
                _remove_empty_output(out, created)
            raise
        if setup.beside_seconds is not None:
            check_seconds = setup.beside_seconds
        result.check_beside = setup.beside_seconds is not None
        result.layout = workers.layout()
        if chat:
            result.conversations = True
            result.pairs = cfg.format == "preference"
            result.prompts = cfg.format == "rl"
    clock.mark("stop workers")
    if not cfg.dry_run:
        # The final validation: each shard's reading from the check record its writer made (a missing or stale record:
        # that shard read again, by as many processes as tokenized), every other check as validate_shards.py makes it.
        result.validation = validate_directory(out, tok, workers=cfg.workers, trust_checks=True)
        clock.mark("validate")
    result.check_seconds, result.total_seconds, result.phases = check_seconds, sum(clock.seconds.values()), clock.seconds
    return result


@dataclass
class _Setup:
    """What `prepare` settled before reading any input, for the run that reads it."""

    cfg: PrepareConfig
    files: list[Path]  # the whole sorted input list: input positions count files in it
    part: tuple[int, int]  # (lo, hi): this run reads files[lo:hi] (all of them unless `cfg.partition`)
    tok: object  # the loaded tokenizer: vocabulary size, EOS, the manifest's fingerprint
    ident: dict  # the output's resume identity (`output.identity`)
    file_stats: list[FileStats]  # one per file of files[lo:hi], counted as they are read
    backend: dict | None  # which library encodes (`backend.choose`), for the manifest and the summary; None until `settle`
    log: Callable[[str], None]
    clock: Phases  # the run's steps, timed
    beside: BesideCheck | None = None  # the fast backend's check running beside the first files (whole files)
    beside_seconds: float | None = None  # how long that check took, once settled

    def settle(self) -> None:
        """Before anything the workers made is kept (the first shard part): the beside-check's verdict, if one runs.
        fastokens giving HF's ids everywhere: go on; otherwise `backend.choose` warns (or refuses `--tokenizer-backend
        fast`) and `_FellBack` ends this pass, to be run again with HF."""
        if self.beside is None:
            return
        check, self.beside = self.beside, None
        difference = check.difference()
        self.beside_seconds = check.seconds
        encoder, self.backend = choose(self.cfg.tokenizer_backend, self.tok, check.fast, difference, check.checked, self.log)
        if encoder is not check.fast:
            raise _FellBack(difference)


class _FellBack(Exception):
    """fastokens differed from HF on the check that ran beside the first files: nothing was kept, run again with HF."""


def _restart_with_hf(stack: contextlib.ExitStack, workers: _Workers, n: int, context) -> _Workers:
    """The `--workers n` started anew, encoding with HF (fastokens did not match it)."""
    if workers.pool:
        workers.pool.close()
    return _Workers.start(stack, workers.unit, n, dataclasses.replace(workers.spec, backend="hf"), context)


@dataclass
class _Workers:
    """The processes that tokenize: a `TaskPool` taking whole files, an `OrderedPool` taking blocks,
    or none (this process alone)."""

    pool: TaskPool | OrderedPool | None
    processes: int
    work_here: bool  # this process tokenizes too, whenever it would wait (`pool_layout`)
    spec: Spec  # how they tokenize
    unit: str  # "files" or "blocks" (`work_unit`)

    @classmethod
    def start(cls, stack: contextlib.ExitStack, unit: str, workers: int, spec: Spec, context) -> _Workers:
        """Start them for `--workers`; `stack` closes the pool."""
        if unit == "files":
            return cls(stack.enter_context(TaskPool(files_worker, spec, workers, context)), workers, False, spec, unit)
        processes, work_here = pool_layout(workers)
        pool = stack.enter_context(OrderedPool(chunk_in_worker, spec, processes, context)) if processes else None
        return cls(pool, processes, work_here, spec, unit)

    def layout(self) -> str:
        """Who tokenized, in the summary's words (`PrepareResult.layout`)."""
        plural = "es" if self.processes > 1 else ""
        return ("this process" if not self.processes else
                f"{self.processes} worker process{plural} taking whole files (this one cuts and orders the shards)" if self.unit == "files" else
                f"{self.processes} worker process{plural}" + ("" if not self.work_here else " and this one, whenever it would wait"))


FILES_PER_WORKER = 4  # `work_unit` auto: whole files once there are this many per worker


def work_unit(requested: str, workers: int, num_files: int) -> str:
    """What a worker takes: "files" (whole files) or "blocks".

    Whole files need no work in this process beyond ordering, so they scale to many cores, but a
    file is the smallest unit: with few files some workers would idle, and one large compressed
    file would be one worker's. So `auto` takes whole files when there are at least
    `FILES_PER_WORKER` per worker, and blocks otherwise (byte ranges of uncompressed files read by
    the workers; compressed ones decompressed here); one worker is this process alone (blocks).
    """
    if requested != "auto":
        return requested
    return "files" if workers > 1 and num_files >= FILES_PER_WORKER * workers else "blocks"


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def pool_layout(workers: int, cores: int | None = None) -> tuple[int, bool]:
    """How `--workers N` runs in blocks mode: (worker processes, whether this process tokenizes too).

    With a core to spare beyond N, N worker processes tokenize and this process only hands out
    blocks and writes and hashes the shards (a fifth to a third of a core at two workers), so the N
    workers never wait for it. Without one, this process is one of the N: N - 1 worker processes, and
    it tokenizes a block itself whenever the next result in order is not ready (`OrderedPool.imap`),
    so no core idles.
    """
    if workers == 1:
        return 0, True
    if (cores or usable_cores()) > workers:
        return workers, False
    return workers - 1, True


def _run(setup: _Setup, workers: _Workers) -> PrepareResult:
    """Resume or start the output, stream files[lo:hi] (all of them unless this is a part) through
    the workers into the shards, write the manifests. Input positions count files in the whole list,
    so skip reports and resume points of a part read as those of a single run."""
    cfg, files, file_stats, log = setup.cfg, setup.files, setup.file_stats, setup.log
    lo, hi = setup.part
    out = Path(cfg.output)
    resume: dict[str, tuple[Path, int, int]] = {}  # split -> (directory, complete shards, input position after them)
    skiplog, noted = SkipLog(), SkipLog()
    start = position(lo, 0)
    resumed_from = None
    created = not out.exists()
    if not cfg.dry_run:
        out.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(out / PIECES_DIR, ignore_errors=True)  # a killed whole-file run's scratch
        resume, start, state = where_to_resume(out, cfg.val_fraction > 0, position(lo, 0))
        if state is not None:
            skiplog = SkipLog.from_dict(state["skipped"])
            noted = SkipLog.from_dict(state.get("noted", SkipLog().to_dict()))  # absent before special-token counts existed
        if start > position(lo, 0) or any(k for _, k, _ in resume.values()):
            resumed_from = _where_or_end(files, resume["train"][2], hi)
            kept = ", ".join(f"{k} {n}" for n, (_, k, _) in resume.items())
            lag = "" if start == resume["train"][2] else (
                f"; from {_where_or_end(files, start, hi)}, where the validation split resumes, to there only its documents are tokenized")
            log(f"resuming {out} from {resumed_from} (complete shards kept: {kept}){lag}")
        atomic_write_json(out / STATE_FILE, setup.ident)
        check = _check_rules(cfg, setup.tok)
        for d, kept, _ in resume.values():  # a run killed between a shard's metadata and its check record: checked now
            for name in (shards.bin_path(d, i).name for i in range(kept)):
                if not check_path(d, name).is_file():
                    check_shard(d, name, *check)

    setup.clock.mark("resume")
    disk_done = sum(s.bytes for s in file_stats[: split_position(start)[0] - lo])
    label = "prepare" if cfg.partition is None else f"prepare part {cfg.partition[0]}/{cfg.partition[1]}"
    progress = Progress(sum(s.bytes for s in file_stats), disk_done, cfg.progress, label, cfg.progress_every)
    run = _Run(setup, skiplog, noted, progress, resume["train"][2] if "train" in resume else start)
    finished = False
    try:
        if workers.unit == "files":
            run.whole_files(workers.pool, resume, start)
        else:
            run.blocks(workers, resume, start)
        finished = True
    finally:
        progress.close(finished)
    setup.clock.mark("tokenizing")
    seconds = setup.clock.seconds["tokenizing"]
    if run.docs == 0 and all(k == 0 for _, k, _ in resume.values()) and cfg.partition is None:
        _no_documents(setup, skiplog, created)

    if cfg.dry_run:
        return PrepareResult(None, file_stats, run.docs, run.tokens, 0, 0, 0, skiplog, seconds, run.text_bytes, run.tokens, noted=noted, backend=setup.backend["name"],
                             run_docs=run.docs)

    manifests = {}
    for name in (["val"] if "val" in resume else []) + ["train"]:  # the top-level manifest last
        manifests[name] = _write_manifest(setup, resume[name][0], _state(skiplog, noted), name, manifests.get("val"))
    train, val = manifests["train"], manifests.get("val")
    setup.clock.mark("manifests")
    return PrepareResult(
        out, file_stats, train.num_docs, train.num_tokens, val.num_docs if val else 0, val.num_tokens if val else 0,
        len(train.shards) + (len(val.shards) if val else 0), skiplog, seconds, run.text_bytes, run.tokens, resumed_from,
        noted=noted, backend=setup.backend["name"], run_docs=run.docs,
    )


def _some(items: list, at_most: int = 5) -> str:
    shown = ", ".join(str(i) for i in items[:at_most])
    return shown + (f" and {len(items) - at_most:,} more" if len(items) > at_most else "")


def _remove_empty_output(out: Path, created: bool) -> None:
    """A run that kept nothing leaves no trace: its state file, and the directories it made if they are empty."""
    (out / STATE_FILE).unlink(missing_ok=True)
    for d in (out / VAL_DIR, out):
        if d.is_dir() and not any(d.iterdir()) and (d != out or created):
            d.rmdir()


def _no_documents(setup: _Setup, skiplog: SkipLog, created: bool) -> None:
    """The whole input held no document: an error naming what each file held, and no trace left of
    the output (no manifest: a source of 0 tokens would look prepared, and validate, and fail only
    when a run tries to read it)."""
    if not setup.cfg.dry_run:
        _remove_empty_output(Path(setup.cfg.output), created)
    held = [f"{s.path} ({'empty, 0 bytes' if s.bytes == 0 else f'{s.skipped:,} records skipped' if s.skipped else 'no records'})" for s in setup.file_stats]
    reasons = ", ".join(f"{reason} {n:,}" for reason, n in sorted(skiplog.counts.items()))
    raise PrepareError(f"no documents in the input ({len(held):,} files): {_some(held)}" + (f"; skipped records: {reasons}" if reasons else "")
                       + (f"; --text-field is {setup.cfg.text_field!r}" if skiplog.counts.get(readers.MISSING_FIELD) else "")
                       + "; nothing was written")


class _Run:
    """The input of one run, in order, into the split writers: documents, skips and notes."""

    def __init__(self, setup: _Setup, skiplog: SkipLog, noted: SkipLog, progress: Progress, train_from: int):
        self.setup = setup
        self.cfg, self.files, self.part, self.file_stats = setup.cfg, setup.files, setup.part, setup.file_stats
        self.tok, self.log = setup.tok, setup.log
        self.skiplog, self.noted = skiplog, noted  # up to the input read so far; shared with the caller
        self.progress = progress
        self.docs = self.tokens = self.text_bytes = 0
        self.reported = self.part[0]  # files before this one have had their --verbose line
        self.train_from = train_from  # train documents before this input position are in complete shards

    def _report_files_before(self, fi: int) -> None:
        while self.cfg.verbose and self.reported < fi:
            log_file(self.log, self.file_stats[self.reported - self.part[0]])
            self.reported += 1

    def _count(self, docs: int, tokens: int, text_bytes: int, disk_done: int) -> None:
        self.docs, self.tokens, self.text_bytes = self.docs + docs, self.tokens + tokens, self.text_bytes + text_bytes
        self.progress.update(disk_done, docs, tokens, text_bytes)

    def _disk_before(self, fi: int) -> int:
        return sum(s.bytes for s in self.file_stats[: fi - self.part[0]])

    def blocks(self, workers: _Workers, resume: dict, start: int) -> None:
        """Blocks of ~1 MiB handed out in order; this process writes the shards (`SplitWriter`)."""
        lo, hi = self.part
        tok = self.tok
        masked, pairs, prompts = self.cfg.format in ("chat", "preference"), self.cfg.format == "preference", self.cfg.format == "rl"
        check = _check_rules(self.cfg, tok)
        splits = {name: SplitWriter(d, self.cfg.shard_tokens, tok.vocab_size, tok.eos_id, k, pos, masked, pairs, prompts, check)
                  for name, (d, k, pos) in resume.items()}
        next_line = 1  # the file line where the next block of the current file starts
        try:
            for (fi, first_line, consumed), res in _ordered_results(_tasks(self.files, start, hi, self.cfg.chunk_bytes, self.train_from), workers):
                self._report_files_before(fi)
                if first_line is not None:
                    next_line = first_line
                res.at_line(next_line)
                next_line += res.n_lines
                stats = self.file_stats[fi - lo]
                stats.docs, stats.tokens, stats.skipped = stats.docs + len(res.doc_lens), stats.tokens + len(res.tokens), stats.skipped + len(res.skips)
                self._add(res, splits, lambda name, sel: _select(res, sel, self.files))
                self._count(len(res.doc_lens), len(res.tokens), res.text_bytes, self._disk_before(fi) + consumed)
            for s in splits.values():
                s.finish(position(hi, 0), _state(self.skiplog, self.noted))
        except BaseException:
            for s in splits.values():
                s.abort()
            raise
        self._report_files_before(hi)

    def whole_files(self, pool: TaskPool, resume: dict, start: int) -> None:
        """Whole files to the workers, which write pieces; this process cuts the pieces' documents
        into shards in input order, hands each piece's share of a shard to the next free worker to
        write at its place, and reads each shard back as it fills (`pieces`)."""
        lo, hi = self.part
        tok, workers = self.tok, len(pool.procs)
        pieces = None if self.cfg.dry_run else Pieces(Path(self.cfg.output) / PIECES_DIR)
        masked, pairs = self.cfg.format != "text", self.cfg.format == "preference"
        splits = {name: PieceSplit(d, self.cfg.shard_tokens, tok.vocab_size, tok.eos_id, k, pos, masked, pairs) for name, (d, k, pos) in resume.items()}
        tasks = deque(plan_tasks(self.files, start, hi, workers, self.cfg.chunk_bytes, pieces.directory if pieces else None, self.train_from))
        by_index = {t.index: t for t in tasks}
        done: dict[int, PieceResult] = {}  # tokenized, waiting for the tasks before them
        assembly = Assembly(_check_rules(self.cfg, tok))
        parts: deque[ShardJob] = deque()  # cut, not yet written
        next_cut = 0
        # Tokenize at most this many tasks ahead of the first one not yet cut, so the pieces waiting
        # for a slow early file stay few.
        window = 4 * workers
        try:
            if not tasks:
                self.setup.settle()
                parts += assembly.made([job for s in splits.values() for job in s.finish(position(hi, 0), _state(self.skiplog, self.noted))])
            while tasks or parts or pool.running:
                for w in pool.idle_workers():
                    if parts:  # first: a written part frees pieces, and the last parts end the run
                        pool.submit("shard", parts.popleft(), w)
                    elif tasks and tasks[0].index < next_cut + window:
                        task = tasks.popleft()
                        pool.submit(task.index, task, w)
                for key, value in pool.wait():
                    assembly.raise_error()
                    if key == "shard":
                        assembly.written(value)
                        if pieces:
                            pieces.written(value)
                        continue
                    done[key] = value
                    if next_cut in done:
                        self.setup.settle()  # the backend's verdict before the first part of a shard is made
                    while next_cut in done:
                        task, res = by_index.pop(next_cut), done.pop(next_cut)
                        made = self._add_piece(task, res, splits)
                        next_cut += 1
                        if not by_index:  # the last task is cut: the last shards can close
                            made += [job for s in splits.values() for job in s.finish(position(hi, 0), _state(self.skiplog, self.noted))]
                        if pieces:
                            pieces.planned(task, made)
                        parts += assembly.made(made)
            assembly.finish()
        except BaseException:
            pool.close(kill=True)  # before its scratch goes: a worker may be writing there
            assembly.abort()
            for s in splits.values():  # the shards the workers were writing stay incomplete: no trace of them
                shards.remove_incomplete(s.directory)
            raise
        finally:
            if pieces:
                pieces.remove()
        self._report_files_before(hi)

    def _add_piece(self, task: Task, res: PieceResult, splits: dict[str, PieceSplit]) -> list[ShardJob]:
        lo = self.part[0]
        for fi, docs, tokens, skipped in res.files:
            self._report_files_before(fi)
            stats = self.file_stats[fi - lo]
            stats.docs, stats.tokens, stats.skipped = stats.docs + docs, stats.tokens + tokens, stats.skipped + skipped
        jobs = []
        self._add(res, splits, lambda name, sel: {"piece": task.piece(name)}, jobs)
        last = task.files[-1][0]
        self._count(len(res.doc_lens), sum(f[2] for f in res.files), res.text_bytes, self._disk_before(last + 1))
        return jobs

    def _add(self, res: ChunkResult | PieceResult, splits: dict, ids, jobs: list | None = None) -> None:
        """Hand a block's or a piece's documents to the split writers and count its skips and notes,
        in input order. `ids(split, sel)`: the split's ids and loss mask (or where they are) as the
        writer's keyword arguments, `sel` selecting the split's documents (None: all)."""
        if self.cfg.format == "preference" and self.cfg.max_tokens and (self.cfg.long_pairs or "refuse") == "refuse":
            long = [s for s in res.skips if s[1] == TOO_LONG]
            if long:
                pos, _, detail = long[0]
                fi, line = split_position(pos)
                raise PrepareError(f"{self.files[fi]}:{line}: a pair of {detail} (--long-pairs refuse). A pair is never cut: rerun "
                                   "with --long-pairs drop to skip such pairs (counted; the complete shards are kept and the run resumes), "
                                   "or with a larger --max-tokens (at most the training seq_len)")
        if self.cfg.strict:
            bad = [s for s in res.skips if s[1] not in POLICY_REASONS]
            if bad:
                pos, reason, *detail = bad[0]
                fi, line = split_position(pos)
                raise PrepareError(f"{self.files[fi]}:{line}: {reason.replace('_', ' ')}" + (f": {detail[0]}" if detail and detail[0] else "")
                                   + " (--strict stops at the first bad record)")
        special_at = res.special_at
        notes = getattr(res, "notes", [])
        if splits:
            state_at = _logs_before(self.skiplog, self.noted, res.skips, special_at, self.files, notes)
            masks = {"train": None} if res.is_val is None else {"train": ~res.is_val, "val": res.is_val}
            for name, mask in masks.items():
                lens, positions = (res.doc_lens, res.positions) if mask is None else (res.doc_lens[mask], res.positions[mask])
                made = splits[name].add(**ids(name, mask), lens=lens, positions=positions, state_at=state_at)
                if jobs is not None:
                    jobs.extend(made)
        for p, reason, *detail in res.skips:
            self.skiplog.add(reason, _where(self.files, p, *detail))
        _note(self.noted, special_at, notes, self.files, None)


def _select(res: ChunkResult, sel: np.ndarray | None, files: list[Path]) -> dict:
    """A block's ids (and loss mask, for conversations; sidecar records with their `file:line`, for RL prompts) as
    `SplitWriter.add`'s arguments; `sel`: the split's documents (None: all)."""
    records = None if res.records is None else [with_source(r, _where(files, int(p))) for r, p in zip(res.records, res.positions)]
    if sel is None:
        return {"tokens": res.tokens, "loss_mask": res.mask, "records": records}
    token_sel = np.repeat(sel, res.doc_lens)
    return {"tokens": res.tokens[token_sel], "loss_mask": None if res.mask is None else res.mask[token_sel],
            "records": None if records is None else [r for r, k in zip(records, sel) if k]}


def _note(noted: SkipLog, special_at: np.ndarray, notes: list, files: list[Path], before: int | None) -> None:
    """Add the notes of a block or piece (those before input position `before`, None: all), in input order."""
    entries = [(int(p), SPECIAL_TEXT) for p in special_at] + list(notes)
    for p, reason in sorted(entries, key=lambda e: e[0]):
        if before is None or p < before:
            noted.add(reason, _where(files, p))


def _state(skiplog: SkipLog, noted: SkipLog) -> dict:
    """The counts a shard's resume point and the manifest carry: records skipped, documents noted."""
    return {"skipped": skiplog.to_dict(), "noted": noted.to_dict()}


def _logs_before(skiplog: SkipLog, noted: SkipLog, skips: list[tuple], special_at: np.ndarray, files: list[Path], notes: list = ()) -> Callable[[int], dict]:
    """`state_at(pos)`: the counts as they stand just before input position `pos`, a position within
    the block or piece whose skips and notes these are (and whose earlier input `skiplog` and `noted` hold)."""
    before, noted_before = skiplog.copy(), noted.copy()

    def state_at(pos: int) -> dict:
        s, n = before.copy(), noted_before.copy()
        for p, reason, *detail in skips:
            if p < pos:
                s.add(reason, _where(files, p, *detail))
        _note(n, special_at, notes, files, pos)
        return _state(s, n)

    return state_at


def _where_or_end(files: list[Path], pos: int, end_file: int) -> str:
    fi, line = split_position(pos)
    return "the end of the input" if fi >= end_file else f"{files[fi]}:{max(line, 1)}"  # line 0: the file's start


def _where(files: list[Path], pos: int, detail: str = "") -> str:
    """`file:line`, and what was wrong there where the reason key does not say it all (a conversation's)."""
    fi, line = split_position(pos)
    return f"{files[fi]}:{line}" + (f" ({detail})" if detail else "")


def _check_rules(cfg: PrepareConfig, tok) -> tuple[ShardRules, str]:
    """What the manifests of this run will say its shards must be (`validate.split_rules`: the keys of `_write_manifest`
    and `shards.write_manifest` they read), for checking each shard as it is written. Should the two ever disagree, the
    final validation finds the records made under other rules and reads those shards again: slower, never wrong."""
    extra = {"pad_id": tok.pad_id, "arguments": {"match_special_tokens": cfg.match_special_tokens}}
    if cfg.format in ("chat", "preference", "rl"):
        extra["chat"] = _chat_record(cfg)
    rules = split_rules(cfg.format in ("chat", "preference"), cfg.format == "preference", cfg.format == "rl", extra)
    return rules, inner_eos_reason(extra)


def _write_manifest(setup: _Setup, directory: Path, state: dict, split: str, val: shards.Manifest | None) -> shards.Manifest:
    cfg, files = setup.cfg, setup.files
    extra = {
        "tool": {"name": "olmo-ds prepare_data", "version": olmo_ds.__version__},
        "arguments": {
            "input": [str(i) for i in cfg.inputs],
            "tokenizer": str(cfg.tokenizer),
            "text_field": cfg.text_field,
            "shard_tokens": cfg.shard_tokens,
            "val_fraction": cfg.val_fraction,
            "eos_token": cfg.eos_token,
            "match_special_tokens": cfg.match_special_tokens,
        },
        "inputs": [{"path": str(f), "bytes": f.stat().st_size} for f in files],
        **state,
        "tokenizer_backend": setup.backend,
    }
    if cfg.format in ("chat", "preference", "rl"):
        extra["arguments"]["format"] = cfg.format
        extra["format"] = cfg.format
        extra["chat"] = _chat_record(cfg)
    if cfg.format == "preference":
        extra["pair_length"] = _pair_length(cfg)
    if cfg.partition is not None:
        extra["partition"] = partition.record(files, cfg.partition)
    if val is not None:
        extra["val"] = {"dir": VAL_DIR, "num_docs": val.num_docs, "num_tokens": val.num_tokens, "shards": len(val.shards)}
    return shards.write_manifest(directory, setup.tok, split, extra)
