"""The on-disk token shard format: the contract between data preparation, validation and loading.

A shard directory holds, for i = 0, 1, ...:
- `shard-NNNNN.bin`: the token ids, raw little-endian, uint16 when every id fits (vocab <= 65536)
  else uint32. Documents are concatenated, each followed by EOS; a document never spans shards.
- `shard-NNNNN.offsets.npy`: int64 array of num_docs + 1 token offsets (0, end of doc 0, ..., num_tokens),
  so document boundaries never need a scan for EOS.
- `shard-NNNNN.json`: metadata (see `ShardMeta`), including a sha256 of the `.bin`.
- `shard-NNNNN.mask` (fine-tuning data only): the loss mask, one byte per token (0 or 1), aligned with
  the `.bin`, unshifted: 1 = this token is a training target (what open-instruct's `labels_mask_part_*.npy`
  hold, `labels != -100`). Its metadata adds `mask`, `mask_checksum` and `trained_tokens` (the count of
  ones); a source's shards either all carry a mask or none do, and its manifest then says `masked: true`
  and sums `trained_tokens`. Pretraining shards and their metadata are unchanged, byte for byte.
- Preference pairs (DPO data): a masked source whose documents come in pairs, document 2i the chosen
  conversation of pair i and 2i + 1 its rejected one, each masked to its final assistant reply only; a pair
  never spans shards, so every shard holds an even number of documents. Each shard's metadata adds
  `preference: true` and `pairs` (num_docs / 2); the manifest says `preference: true` and sums `pairs`.
  Why pairs live as adjacent documents of an ordinary masked source: every guarantee of chat data (order,
  resume points, partitions, merge, validation of masks) carries over untouched, and a reader that knows
  nothing of pairs still sees well-formed conversations. Chat and pretraining shards carry neither key.
- RL prompts (`shard-NNNNN.prompts.jsonl`, reinforcement learning with verifiable rewards): each document is a
  prompt, its messages rendered by the chat template with the generation prompt appended (no EOS: the model
  writes the rest), and the sidecar holds one JSON line per document, in document order: `{"source": "file:line",
  "verifier": name, "dataset": the row's value, "ground_truth": ...}`. The metadata adds `prompts` (the sidecar's
  name), `prompts_checksum` (its sha256) and `verifiers` (documents per verifier); the manifest says
  `prompts: true` and sums `verifiers`. Why a sidecar and not the ids: a ground truth is any JSON value (a
  number, LaTeX, an IFEval constraint object) that the trainer reads back as written, never tokens.
and, written last, `manifest.json` with the totals, the tokenizer fingerprint and the arguments.

Every file appears under its final name only when complete (written to a temporary name, fsynced,
then renamed), so a crash never leaves a half-written shard that looks whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from olmo_ds.atomic import atomic_write_bytes, atomic_write_json

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_PREFIX = "shard-"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits in it, else uint32 (OLMo 2/3's 100,278 ids need uint32)."""
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")


def shard_stem(index: int) -> str:
    return f"{SHARD_PREFIX}{index:05d}"


def bin_path(directory: Path, index: int) -> Path:
    return Path(directory) / f"{shard_stem(index)}.bin"


def offsets_path(directory: Path, index: int) -> Path:
    return Path(directory) / f"{shard_stem(index)}.offsets.npy"


def meta_path(directory: Path, index: int) -> Path:
    return Path(directory) / f"{shard_stem(index)}.json"


def mask_path(directory: Path, index: int) -> Path:
    return Path(directory) / f"{shard_stem(index)}.mask"


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return "sha256:" + h.hexdigest()


@dataclass
class ShardMeta:
    num_tokens: int
    num_docs: int
    avg_doc_len: float
    dtype: str  # "uint16" | "uint32"
    vocab_size: int
    max_token_id: int
    eos_id: int
    checksum: str  # "sha256:<hex>" of the .bin
    bin: str  # file names, relative to the shard directory
    offsets: str
    format_version: int = FORMAT_VERSION
    # Fine-tuning shards only (None, and absent from the file, on pretraining shards):
    mask: str | None = None  # the loss mask's file name, relative to the shard directory
    mask_checksum: str | None = None  # "sha256:<hex>" of the mask file
    trained_tokens: int | None = None  # tokens whose mask is 1
    # Preference shards only (None, and absent from the file, elsewhere):
    preference: bool | None = None  # documents 2i, 2i + 1 are pair i's chosen and rejected conversations
    pairs: int | None = None  # num_docs / 2
    # RL prompt shards only (None, and absent from the file, elsewhere):
    prompts: str | None = None  # the sidecar's file name: one JSON line (source, verifier, ground truth) per document
    prompts_checksum: str | None = None  # "sha256:<hex>" of the sidecar
    verifiers: dict | None = None  # documents per verifier name

    @property
    def masked(self) -> bool:
        return self.mask is not None

    @property
    def is_preference(self) -> bool:
        return bool(self.preference)

    @property
    def is_prompts(self) -> bool:
        return self.prompts is not None

    @classmethod
    def load(cls, path: Path) -> "ShardMeta":
        d = _read_json_object(path, "shard metadata")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - set(d) - set(OPTIONAL_META)
        if missing:
            raise ValueError(f"{path}: shard metadata lacks keys {sorted(missing)}")
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict:
        """The metadata as written: the mask's keys only where there is a mask, the pairs' only on preference shards."""
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if not (k in MASK_META + PREFERENCE_META + PROMPT_META and v is None)}


MASK_META = ("mask", "mask_checksum", "trained_tokens")
PREFERENCE_META = ("preference", "pairs")
PROMPT_META = ("prompts", "prompts_checksum", "verifiers")
OPTIONAL_META = ("format_version", *MASK_META, *PREFERENCE_META, *PROMPT_META)
PROMPTS_SUFFIX = ".prompts.jsonl"


def prompts_path(directory: Path, index: int) -> Path:
    return Path(directory) / f"{shard_stem(index)}{PROMPTS_SUFFIX}"


def read_prompt_records(path: Path, meta: ShardMeta) -> list[dict]:
    """The sidecar of an RL prompt shard, one dict per document; a ValueError naming the file and line when it
    does not hold one JSON object with 'verifier' and 'ground_truth' per document."""
    lines = Path(path).read_bytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if len(lines) != meta.num_docs:
        raise ValueError(f"{path}: {len(lines)} prompt records for {meta.num_docs} documents (truncated or corrupt; prepare the data again)")
    out = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("verifier"), str) or "ground_truth" not in record:
            raise ValueError(f"{path}:{i + 1}: not a prompt record (a JSON object with 'verifier' and 'ground_truth')")
        out.append(record)
    return out


def preference_fields(num_docs: int, masked: bool, where: Path) -> dict:
    """The metadata keys of a preference shard of `num_docs` documents; raises naming `where` when they
    cannot be pairs (an odd count, or no loss mask to say which reply each side trains)."""
    if not masked:
        raise ValueError(f"{where}: a preference shard needs a loss mask (each side trains its final reply only)")
    if num_docs % 2:
        raise ValueError(f"{where}: a preference shard of {num_docs} documents: pairs are (chosen, rejected) documents, "
                         "so the count must be even and a pair never spans shards")
    return {"preference": True, "pairs": num_docs // 2}


def open_mask(path: Path, meta: ShardMeta) -> np.ndarray:
    """Memory-map a shard's loss mask as bool (zero-copy, no descriptor kept). Raises naming the file when
    its size disagrees with the metadata's token count."""
    path = Path(path)
    size = path.stat().st_size
    if size != meta.num_tokens:
        raise ValueError(f"{path}: loss mask of {size} bytes != num_tokens {meta.num_tokens} (one byte per token; truncated or corrupt)")
    if meta.num_tokens == 0:
        return np.zeros(0, dtype=bool)
    return map_file(path)[: meta.num_tokens].view(np.bool_)


def mask_bytes(mask: np.ndarray) -> bytes:
    """A loss mask as stored: one byte, 0 or 1, per token."""
    return np.ascontiguousarray(np.asarray(mask, dtype=bool)).view(np.uint8).tobytes()


def write_shard(directory: Path, index: int, tokens: np.ndarray, doc_offsets: np.ndarray, *, vocab_size: int, eos_id: int,
                mask: np.ndarray | None = None, preference: bool = False) -> ShardMeta:
    """Write one complete shard (bin, offsets, the loss mask where given, metadata), each file atomically,
    metadata last.

    `tokens` must already have the shard dtype; `doc_offsets` starts at 0 and ends at len(tokens);
    `mask`, one bool per token (True = trained); `preference`: the documents are (chosen, rejected) pairs.
    """
    directory = Path(directory)
    dtype = dtype_for_vocab(vocab_size)
    tokens = np.ascontiguousarray(tokens, dtype=dtype)
    doc_offsets = np.asarray(doc_offsets, dtype=np.int64)
    assert doc_offsets[0] == 0 and doc_offsets[-1] == len(tokens), "offsets must span the shard"
    raw = tokens.tobytes()
    atomic_write_bytes(bin_path(directory, index), raw)
    off_tmp = offsets_path(directory, index).with_suffix(".tmp.npy")
    with open(off_tmp, "wb") as f:
        np.save(f, doc_offsets)
        f.flush()
        os.fsync(f.fileno())
    os.replace(off_tmp, offsets_path(directory, index))
    mask_fields = {}
    if mask is not None:
        assert len(mask) == len(tokens), "one mask value per token"
        raw_mask = mask_bytes(mask)
        atomic_write_bytes(mask_path(directory, index), raw_mask)
        mask_fields = dict(mask=mask_path(directory, index).name, mask_checksum="sha256:" + hashlib.sha256(raw_mask).hexdigest(),
                           trained_tokens=int(np.count_nonzero(np.asarray(mask, dtype=bool))))
    num_docs = len(doc_offsets) - 1
    if preference:
        mask_fields.update(preference_fields(num_docs, mask is not None, meta_path(directory, index)))
    meta = ShardMeta(
        num_tokens=int(len(tokens)),
        num_docs=int(num_docs),
        avg_doc_len=float(len(tokens) / num_docs) if num_docs else 0.0,
        dtype=dtype.name,
        vocab_size=int(vocab_size),
        max_token_id=int(tokens.max()) if len(tokens) else -1,
        eos_id=int(eos_id),
        checksum="sha256:" + hashlib.sha256(raw).hexdigest(),
        bin=bin_path(directory, index).name,
        offsets=offsets_path(directory, index).name,
        **mask_fields,
    )
    atomic_write_json(meta_path(directory, index), meta.to_dict())
    return meta


WRITEBACK_BYTES = 8 << 20  # a writer asks the kernel to start writing its file out every this many bytes


@functools.cache
def _sync_file_range():
    """Linux's `sync_file_range` (through the C library), or None where there is none."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return fn


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing these bytes of a file to disk now, without waiting for it.

    Dirty pages otherwise wait in memory until the file's fsync, which then writes the whole shard
    while its writer waits, and the disk idles in between. Started early, the disk writes while the
    writer tokenizes (or hashes the next block), and the fsync only waits for the last few blocks.
    A hint: where there is no `sync_file_range` nothing happens, and an error would show at the
    fsync, which stays what makes a file durable.
    """
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE: start writing, do not wait


@contextlib.contextmanager
def naming(path: Path):
    """Put the file's name into a write error: a bare "[Errno 28] No space left on device" names nothing."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def temporary_paths(directory: Path, index: int) -> tuple[Path, Path, Path]:
    """Where a shard's `.bin`, its offsets (raw int64, converted to `.offsets.npy` when it closes) and its mask are
    written until the shard is complete."""
    return (bin_path(directory, index).with_name(bin_path(directory, index).name + ".tmp"),
            offsets_path(directory, index).with_name(f"{shard_stem(index)}.offsets.raw.tmp"),
            mask_path(directory, index).with_name(mask_path(directory, index).name + ".tmp"))


def _mask_fields(directory: Path, index: int, sha256_hex: str, trained_tokens: int) -> dict:
    return dict(mask=mask_path(directory, index).name, mask_checksum="sha256:" + sha256_hex, trained_tokens=int(trained_tokens))


def _publish(directory: Path, index: int, num_docs: int, masked: bool) -> None:
    """A shard's written (and fsynced) temporaries under their final names, the raw offsets as `.offsets.npy`:
    everything but the metadata, which goes last."""
    bin_tmp, off_tmp, mask_tmp = temporary_paths(directory, index)
    os.replace(bin_tmp, bin_path(directory, index))
    if masked:
        os.replace(mask_tmp, mask_path(directory, index))
    offsets = np.memmap(off_tmp, dtype="<i8", mode="r", shape=(num_docs + 1,)) if num_docs else np.zeros(1, dtype="<i8")
    npy_tmp = offsets_path(directory, index).with_suffix(".tmp.npy")
    out = np.lib.format.open_memmap(npy_tmp, mode="w+", dtype="<i8", shape=(num_docs + 1,))
    step = 1 << 22  # copy in blocks: a shard of many tiny documents must not need its offsets in RAM
    for start in range(0, len(out), step):
        out[start : start + step] = offsets[start : start + step]
    out.flush()
    del out, offsets
    with open(npy_tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(npy_tmp, offsets_path(directory, index))
    os.unlink(off_tmp)


def _write_meta(directory: Path, index: int, extra: dict | None, *, num_tokens: int, num_docs: int, dtype: np.dtype, vocab_size: int,
                max_token_id: int, eos_id: int, checksum: str, **optional) -> ShardMeta:
    """The shard's metadata, written last: from then on the shard is complete."""
    meta = ShardMeta(num_tokens=num_tokens, num_docs=num_docs, avg_doc_len=float(num_tokens / num_docs) if num_docs else 0.0, dtype=dtype.name,
                     vocab_size=int(vocab_size), max_token_id=int(max_token_id), eos_id=int(eos_id), checksum="sha256:" + checksum,
                     bin=bin_path(directory, index).name, offsets=offsets_path(directory, index).name, **optional)
    atomic_write_json(meta_path(directory, index), {**(extra or {}), **meta.to_dict()})
    return meta


class ShardWriter:
    """Streams one shard to disk with memory bounded by the batch appended, not by the shard size.

    Ids and document offsets go to temporary files while the shard grows; `close` fsyncs them,
    renames them to their final names and writes the metadata last, so that a shard whose `.json`
    exists is complete, and anything else left by a crash is a temporary or an orphan to delete.
    `extra` keys are stored in the metadata beside `ShardMeta`'s (data preparation keeps its resume
    point there). `masked`: the shard carries a loss mask, given with every `append`; `preference`: its
    documents are (chosen, rejected) pairs (a masked shard; `close` refuses an odd number of documents).
    """

    def __init__(self, directory: Path, index: int, *, vocab_size: int, eos_id: int, masked: bool = False, preference: bool = False,
                 prompts: bool = False):
        self.directory = Path(directory)
        self.index = index
        self.preference = preference
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.dtype = dtype_for_vocab(vocab_size)
        self.num_tokens = 0
        self.num_docs = 0
        self.max_token_id = -1
        self._hash = hashlib.sha256()
        self._written_out = 0  # bytes of the .bin the kernel was asked to start writing to disk (`start_writeback`)
        self._bin_tmp, self._off_tmp, self._mask_tmp = temporary_paths(self.directory, index)
        self._bin = open(self._bin_tmp, "wb")
        self._off = open(self._off_tmp, "wb")
        self._off.write(np.zeros(1, dtype="<i8").tobytes())
        self.trained_tokens = 0
        self._mask_hash = hashlib.sha256()
        self._mask = open(self._mask_tmp, "wb") if masked else None
        self._prompts_tmp = prompts_path(self.directory, index).with_name(prompts_path(self.directory, index).name + ".tmp")
        self._prompts = open(self._prompts_tmp, "wb") if prompts else None
        self._prompts_hash = hashlib.sha256()
        self._verifiers: dict[str, int] = {}

    def _files(self) -> list:
        return ([(self._bin, self._bin_tmp), (self._off, self._off_tmp)] + ([(self._mask, self._mask_tmp)] if self._mask else [])
                + ([(self._prompts, self._prompts_tmp)] if self._prompts else []))

    def append(self, tokens: np.ndarray, doc_lens: np.ndarray, mask: np.ndarray | None = None, records: list[bytes] | None = None) -> None:
        """Append whole documents: `tokens` (shard dtype, each document ending in EOS) and their lengths;
        `mask`, one bool per token, exactly when the writer is `masked`; `records`, one JSON object (bytes, no
        newline) per document, exactly when the writer holds `prompts`."""
        if len(doc_lens) == 0:
            return
        if (records is None) != (self._prompts is None):
            raise ValueError(f"{self._bin_tmp}: a {'prompt' if self._prompts else 'plain'} shard appended {'without' if records is None else 'with'} prompt records")
        if records is not None:
            if len(records) != len(doc_lens):
                raise ValueError(f"{self._prompts_tmp}: {len(records)} prompt records for {len(doc_lens)} documents")
            raw_records = b"".join(r + b"\n" for r in records)
            with naming(self._prompts_tmp):
                self._prompts.write(raw_records)
            self._prompts_hash.update(raw_records)
            for r in records:
                name = json.loads(r)["verifier"]
                self._verifiers[name] = self._verifiers.get(name, 0) + 1
        if (mask is None) != (self._mask is None):
            raise ValueError(f"{self._bin_tmp}: a {'masked' if self._mask else 'plain'} shard appended {'without' if mask is None else 'with'} a mask")
        if mask is not None:
            raw_mask = mask_bytes(mask)
            if len(raw_mask) != len(tokens):
                raise ValueError(f"{self._mask_tmp}: {len(raw_mask)} mask values for {len(tokens)} tokens")
            with naming(self._mask_tmp):
                self._mask.write(raw_mask)
            self._mask_hash.update(raw_mask)
            self.trained_tokens += int(np.count_nonzero(np.asarray(mask, dtype=bool)))
        raw = memoryview(np.ascontiguousarray(tokens, dtype=self.dtype)).cast("B")
        ends = self.num_tokens + np.cumsum(doc_lens, dtype=np.int64)
        with naming(self._bin_tmp):
            self._bin.write(raw)
            end = int(ends[-1]) * self.dtype.itemsize
            if end - self._written_out >= WRITEBACK_BYTES:
                self._bin.flush()
                start_writeback(self._bin.fileno(), self._written_out, end - self._written_out)
                self._written_out = end
        with naming(self._off_tmp):
            self._off.write(ends.astype("<i8").tobytes())
        self._hash.update(raw)
        self.num_tokens = int(ends[-1])
        self.num_docs += len(doc_lens)
        self.max_token_id = max(self.max_token_id, int(tokens.max()))

    def close(self, extra: dict | None = None) -> ShardMeta:
        pair_fields = preference_fields(self.num_docs, self._mask is not None, meta_path(self.directory, self.index)) if self.preference else {}
        for f, path in self._files():
            with naming(path):
                f.flush()
                os.fsync(f.fileno())
            f.close()
        mask_fields = _mask_fields(self.directory, self.index, self._mask_hash.hexdigest(), self.trained_tokens) if self._mask is not None else {}
        prompt_fields = {}
        if self._prompts is not None:
            os.replace(self._prompts_tmp, prompts_path(self.directory, self.index))
            prompt_fields = dict(prompts=prompts_path(self.directory, self.index).name, prompts_checksum="sha256:" + self._prompts_hash.hexdigest(),
                                 verifiers=dict(sorted(self._verifiers.items())))
        _publish(self.directory, self.index, self.num_docs, self._mask is not None)
        return _write_meta(self.directory, self.index, extra, num_tokens=self.num_tokens, num_docs=self.num_docs, dtype=self.dtype,
                           vocab_size=self.vocab_size, max_token_id=self.max_token_id, eos_id=self.eos_id, checksum=self._hash.hexdigest(),
                           **mask_fields, **pair_fields, **prompt_fields)

    def abort(self) -> None:
        """Close and delete the temporary files (the shard never appears).

        Runs after a failed write, typically a full disk, where closing flushes the buffer and fails
        again; that data is being thrown away, so the error must not stop the clean-up or hide the first.
        """
        for f, path in self._files():
            with contextlib.suppress(OSError):
                f.close()
            path.unlink(missing_ok=True)


_READ_BACK = bytearray(1 << 20)  # `_reads_back`'s buffer, reused (a fresh one per read costs more than the read); one writer per process at a time


def _reads_back(fd: int, data: memoryview, offset: int) -> bool:
    """Whether the file holds `data` (bytes) at `offset`: read back in blocks into one buffer, compared by memcmp."""
    step = len(_READ_BACK)
    for k in range(0, len(data), step):
        chunk = data[k : k + step]
        buf = _READ_BACK if len(chunk) == step else bytearray(len(chunk))
        if os.preadv(fd, [buf], offset + k) != len(chunk) or buf != chunk:  # bytearray != buffer: memcmp
            return False
    return True


class ShardInParts:
    """One shard written in parts whose places are known before any is written (the tokens and documents before
    each), by any process and in any order; `ShardWriter` writes one stream in order instead. Data preparation's
    whole-file mode writes a shard's parts this way on whichever workers are free, and one reader follows the
    written prefix to hash it (`prepare.pieces`), so no shard waits on one writer working through its parts in turn.

    The files are `ShardWriter`'s, under the same temporary names until `close`, and so are the closed shard's bytes
    for the same documents. The object holds only names and numbers, so it travels to the workers with each part."""

    def __init__(self, directory: Path, index: int, *, vocab_size: int, eos_id: int, masked: bool = False, preference: bool = False):
        self.directory, self.index = Path(directory), index
        self.vocab_size, self.eos_id = vocab_size, eos_id
        self.masked, self.preference = masked, preference
        self.dtype = dtype_for_vocab(vocab_size)

    @property
    def bin_tmp(self) -> Path:
        return temporary_paths(self.directory, self.index)[0]

    @property
    def mask_tmp(self) -> Path:
        return temporary_paths(self.directory, self.index)[2]

    def _paths(self) -> list[Path]:
        bin_tmp, off_tmp, mask_tmp = temporary_paths(self.directory, self.index)
        return [bin_tmp, off_tmp] + ([mask_tmp] if self.masked else [])

    def create(self) -> None:
        """Make the temporaries empty (the offsets' leading 0), before any part is written."""
        for path in self._paths():
            with naming(path), open(path, "wb") as f:
                if path.name.endswith(".offsets.raw.tmp"):
                    f.write(np.zeros(1, dtype="<i8").tobytes())

    def write(self, at_token: int, at_doc: int, tokens: np.ndarray, doc_lens: np.ndarray, mask: np.ndarray | None = None) -> tuple[int, int]:
        """Write whole documents at their place: their ids from token `at_token` on, their offsets after document
        `at_doc`'s, their mask (exactly when the shard is `masked`) beside the ids. The ids are read back and
        compared with what was meant, so the reader that hashes the file (`close`'s checksum) hashes these ids.
        Returns their largest id and their EOS count."""
        if (mask is None) == self.masked:
            raise ValueError(f"{self.bin_tmp}: a {'masked' if self.masked else 'plain'} shard written {'without' if mask is None else 'with'} a mask")
        bin_tmp, off_tmp, mask_tmp = temporary_paths(self.directory, self.index)
        raw = memoryview(np.ascontiguousarray(tokens, dtype=self.dtype)).cast("B")
        at = at_token * self.dtype.itemsize
        ends = (at_token + np.cumsum(doc_lens, dtype=np.int64)).astype("<i8")
        parts = [(bin_tmp, at, raw), (off_tmp, (at_doc + 1) * 8, memoryview(ends).cast("B"))]
        if mask is not None:
            raw_mask = mask_bytes(mask)
            if len(raw_mask) != len(tokens):
                raise ValueError(f"{mask_tmp}: {len(raw_mask)} mask values for {len(tokens)} tokens")
            parts.append((mask_tmp, at_token, memoryview(raw_mask)))
        for path, offset, data in parts:
            with naming(path):
                fd = os.open(path, os.O_RDWR)
                try:
                    done = 0
                    while done < len(data):
                        done += os.pwrite(fd, data[done:], offset + done)
                    if path == bin_tmp:
                        start_writeback(fd, offset, len(data))
                        if not _reads_back(fd, data, offset):
                            raise OSError(errno.EIO, f"the bytes read back at {offset:,} are not those just written there", str(path))
                finally:
                    os.close(fd)
        ids = np.frombuffer(raw, dtype=self.dtype)
        return (int(ids.max()), int(np.count_nonzero(ids == self.eos_id))) if len(ids) else (-1, 0)

    def close(self, num_tokens: int, num_docs: int, checksum: str, max_token_id: int, mask_checksum: str | None = None,
              trained_tokens: int = 0, extra: dict | None = None) -> ShardMeta:
        """Once every part is written: `checksum` (sha256 hex) is the reader's, who read the whole `.bin` in order, and
        `max_token_id` the largest id the parts wrote; `mask_checksum` and `trained_tokens` likewise for the mask.
        Refuses a file of another size than its parts make."""
        pair_fields = preference_fields(num_docs, self.masked, meta_path(self.directory, self.index)) if self.preference else {}
        for path, size in zip(self._paths(), (num_tokens * self.dtype.itemsize, (num_docs + 1) * 8, num_tokens)):
            with naming(path):
                if path.stat().st_size != size:
                    raise OSError(errno.EIO, f"{path.stat().st_size:,} bytes once all its parts are written, not {size:,}", str(path))
                with open(path, "rb+") as f:
                    os.fsync(f.fileno())
        mask_fields = _mask_fields(self.directory, self.index, mask_checksum, trained_tokens) if self.masked else {}
        _publish(self.directory, self.index, num_docs, self.masked)
        return _write_meta(self.directory, self.index, extra, num_tokens=num_tokens, num_docs=num_docs, dtype=self.dtype, vocab_size=self.vocab_size,
                           max_token_id=max_token_id, eos_id=self.eos_id, checksum=checksum, **mask_fields, **pair_fields)


class ShardCutter:
    """Where the shards of a document stream close: before a document that would take the open
    shard past `shard_tokens` tokens, unless the shard is still empty (a document longer than the
    limit gets a shard of its own; documents are never split). The one rule: `ShardedWriter` writes
    by it, and data preparation's whole-file mode plans shards from pieces by it
    (`prepare.pieces`), so both give the same shards for the same documents."""

    def __init__(self, shard_tokens: int):
        self.shard_tokens = shard_tokens
        self.tokens = 0  # of the open shard
        self.docs = 0

    def feed(self, lens: np.ndarray) -> list[int]:
        """The next documents' lengths → the indices k (into `lens`) where a shard closes just
        before document k; the open shard then starts anew with document k."""
        cum = np.cumsum(lens, dtype=np.int64)
        breaks, done = [], 0
        while done < len(cum):
            base = int(cum[done - 1]) if done else 0
            end = int(np.searchsorted(cum, base + self.shard_tokens - self.tokens, side="right"))
            if end == done and self.docs == 0:
                end = done + 1
            if end > done:
                self.tokens += int(cum[end - 1]) - base
                self.docs += end - done
            if end < len(cum):
                breaks.append(end)
                self.tokens = self.docs = 0
            done = end
        return breaks

    def feed_pairs(self, lens: np.ndarray) -> list[int]:
        """`feed` for preference pairs: `lens` are whole pairs' documents (chosen, rejected, ...); each pair
        counts as one document, so a shard closes only between pairs. Returns document indices, as `feed`."""
        if len(lens) % 2:
            raise ValueError(f"{len(lens)} documents of preference pairs: pairs are added whole")
        lens = np.asarray(lens)
        return [2 * k for k in self.feed(lens[0::2] + lens[1::2])]


class ShardedWriter:
    """Cuts a stream of whole documents into shards of at most `shard_tokens` tokens (`ShardCutter`).

    Shard boundaries depend only on the document stream, so the same documents always give the same shards.
    `preference`: the documents come in (chosen, rejected) pairs and every `add` holds whole pairs; the cutter
    then sees each pair as one document, so a shard closes only between pairs.
    """

    def __init__(self, directory: Path, shard_tokens: int, *, vocab_size: int, eos_id: int, next_index: int = 0, masked: bool = False,
                 preference: bool = False, prompts: bool = False):
        self.directory = Path(directory)
        self.masked = masked
        self.prompts = prompts
        self.preference = preference
        self.shard_tokens = shard_tokens
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.next_index = next_index
        self.writer: ShardWriter | None = None
        self.cutter = ShardCutter(shard_tokens)

    def add(self, tokens: np.ndarray, lens: np.ndarray, close_extra=None, mask: np.ndarray | None = None, records: list[bytes] | None = None) -> None:
        """Append documents (and their tokens' loss mask, for a `masked` writer); `close_extra(k)` gives the
        metadata extras of a shard closed just before document k of this batch (e.g. where in the input
        the next shard starts)."""
        ends = np.cumsum(lens, dtype=np.int64)
        try:
            breaks = self.cutter.feed_pairs(lens) if self.preference else self.cutter.feed(lens)
        except ValueError as e:
            raise ValueError(f"{self.directory}: {e}") from None
        start = 0
        for k in [*breaks, len(lens)]:
            if k > start:
                if self.writer is None:
                    self.writer = ShardWriter(self.directory, self.next_index, vocab_size=self.vocab_size, eos_id=self.eos_id, masked=self.masked,
                                              preference=self.preference, prompts=self.prompts)
                lo, hi = (ends[start - 1] if start else 0), ends[k - 1]
                self.writer.append(tokens[lo:hi], lens[start:k], None if mask is None else mask[lo:hi], None if records is None else records[start:k])
            if k < len(lens):
                self._close(close_extra(k) if close_extra else None)
            start = k

    def _close(self, extra: dict | None) -> None:
        self.writer.close(extra)
        self.writer = None
        self.next_index += 1

    def finish(self, extra: dict | None = None) -> None:
        """Close the last, partly filled shard."""
        if self.writer is not None:
            self._close(extra)

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None


def remove_incomplete(directory: Path) -> None:
    """Delete what shard writers stopped mid-shard left behind: files under temporary names, and the
    files of a shard whose metadata (written last) is missing."""
    for p in Path(directory).glob(f"{SHARD_PREFIX}*"):
        if p.name.endswith((".tmp", ".tmp.npy")) or not (p.parent / (p.name.split(".")[0] + ".json")).exists():
            p.unlink(missing_ok=True)


def list_shards(directory: Path) -> list[Path]:
    """The `.bin` files of a shard directory, in name order (= data order)."""
    return sorted(Path(directory).glob(f"{SHARD_PREFIX}[0-9]*.bin"))


class _FileMap:
    """A whole file mapped read-only into memory, holding no file descriptor (`map_file`).

    numpy reads it through `__array_interface__`, which makes this object the base of every array
    viewing it, so the mapping lives exactly as long as the last such array.
    """

    def __init__(self, path: Path, size: int, addr: int, munmap) -> None:
        self.path, self.size, self._addr, self._munmap = path, size, addr, munmap
        self.__array_interface__ = {"data": (addr, True), "shape": (size,), "typestr": "|u1", "version": 3}

    def __del__(self) -> None:
        self._munmap(self._addr, self.size)


@functools.cache
def _libc_mmap():
    """The C library's (mmap, munmap), or None where there are none (then `map_file` keeps a descriptor)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        mmap_fn, munmap_fn = libc.mmap, libc.munmap
    except (OSError, AttributeError):
        return None
    mmap_fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64)
    mmap_fn.restype = ctypes.c_void_p
    munmap_fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    munmap_fn.restype = ctypes.c_int
    return mmap_fn, munmap_fn


def map_file(path: Path) -> np.ndarray:
    """A file's bytes as a read-only uint8 array mapped from the page cache, holding no file descriptor.

    Why not `np.memmap` / `np.load(mmap_mode=...)`: Python's `mmap` keeps a duplicate of the file's
    descriptor for the map's lifetime, so a loader over N shards held 2N descriptors for the whole run
    and 1,500 files failed under the common `ulimit -n 1024`. A mapping made with the C library's
    `mmap` needs its descriptor only while it is made: the file is opened, mapped, closed. The data
    are read as before (zero-copy, from the page cache); what stays per file is one mapping, of which
    Linux allows `vm.max_map_count` (65,530 by default) per process.
    """
    import errno
    import mmap

    path = Path(path)
    fns = _libc_mmap()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return np.zeros(0, dtype=np.uint8)
        if fns is None:
            return np.memmap(path, dtype=np.uint8, mode="r")
        addr = fns[0](None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if addr is None or addr == (1 << (8 * np.dtype(np.intp).itemsize)) - 1:  # MAP_FAILED, (void *) -1
        import ctypes

        err = ctypes.get_errno()
        hint = " (each mapped file takes one of the process's vm.max_map_count maps)" if err == errno.ENOMEM else ""
        raise OSError(err, f"cannot map the file into memory: {os.strerror(err)}{hint}", str(path))
    return np.asarray(_FileMap(path, size, addr, fns[1]))


def open_tokens(path: Path, meta: ShardMeta) -> np.ndarray:
    """Memory-map a shard's ids (zero-copy, no descriptor kept: `map_file`). Raises if the file size disagrees with the metadata."""
    path = Path(path)
    dtype = np.dtype(meta.dtype).newbyteorder("<")
    expected = meta.num_tokens * dtype.itemsize
    size = path.stat().st_size
    if size != expected:
        raise ValueError(f"{path}: size {size} bytes != num_tokens {meta.num_tokens} x {dtype.itemsize} bytes (truncated or corrupt shard)")
    if meta.num_tokens == 0:
        return np.zeros(0, dtype=dtype)
    return map_file(path)[:expected].view(dtype)


def load_offsets(path: Path) -> np.ndarray:
    """A shard's document offsets (an int64 `.npy`), memory-mapped like `map_file`: no descriptor kept."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read_header(f)  # one dimension: C and Fortran order are the same
            data_start = f.tell()
    except (ValueError, EOFError) as e:  # empty, truncated or not an .npy file: numpy's message names no file
        raise ValueError(f"{path}: unreadable document offsets ({e}); the shard is corrupt, rerun prepare_data.py") from None
    if len(shape) != 1:
        raise ValueError(f"{path}: document offsets have shape {shape}, expected one dimension")
    if dtype.kind not in "iu":
        raise ValueError(f"{path}: document offsets of dtype {dtype}, expected integers")
    nbytes = shape[0] * dtype.itemsize
    data = map_file(path)
    if len(data) < data_start + nbytes:
        raise ValueError(f"{path}: unreadable document offsets (the file holds {len(data) - data_start} bytes of {nbytes}); "
                         "the shard is corrupt, rerun prepare_data.py")
    return data[data_start : data_start + nbytes].view(dtype)


def _read_json_object(path: Path, what: str) -> dict:
    """A JSON object from `path`; an empty, truncated or foreign file is a ValueError naming it."""
    try:
        d = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: {what} is not valid JSON ({e}); the file is truncated or corrupt") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: {what} must be a JSON object, got {type(d).__name__}")
    return d


@dataclass
class Manifest:
    num_tokens: int
    num_docs: int
    shards: list[str]
    dtype: str
    vocab_size: int
    eos_id: int
    tokenizer_fingerprint: str
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)  # arguments, inputs, skipped counts, versions...

    @classmethod
    def load(cls, directory: Path) -> "Manifest":
        path = Path(directory) / MANIFEST
        if not path.exists():
            raise FileNotFoundError(f"{path}: no manifest; is {directory} a shard directory written by scripts/prepare_data.py?")
        d = _read_json_object(path, "manifest")
        names = [f.name for f in dataclasses.fields(cls) if f.name != "extra"]
        missing = [n for n in names if n not in d and n != "format_version"]
        if missing:
            raise ValueError(f"{path}: manifest lacks keys {missing}")
        core = {k: d.pop(k) for k in names if k in d}
        return cls(**core, extra=d)

    def save(self, directory: Path) -> None:
        d = dataclasses.asdict(self)
        extra = d.pop("extra")
        atomic_write_json(Path(directory) / MANIFEST, {**extra, **d})

    @property
    def masked(self) -> bool:
        """Whether the source's shards carry loss masks (fine-tuning data)."""
        return bool(self.extra.get("masked", False))

    @property
    def preference(self) -> bool:
        """Whether the source's documents are (chosen, rejected) pairs (DPO data; a masked source too)."""
        return bool(self.extra.get("preference", False))

    @property
    def prompts(self) -> bool:
        """Whether the source's documents are RL prompts with a ground truth each (`shard-NNNNN.prompts.jsonl`)."""
        return bool(self.extra.get("prompts", False))


def write_manifest(directory: Path, tokenizer, split: str, extra: dict, metas: list[ShardMeta] | None = None, names: list[str] | None = None) -> Manifest:
    """Write `manifest.json` last, over the shards in `metas` (default: the directory's, in order).

    The one manifest writer (data preparation, the merge of parts, the Megatron import, in-place
    token files): totals are the sums over the shards' metadata, the tokenizer (`vocab_size`,
    `eos_id`, `pad_id`, `fingerprint`) sets the rest, and `split` and `pad_id` are always recorded.
    `names`: the listed entries when they are not the `.bin` names (in-place token files, whose
    `shard-NNNNN.json` points at a file elsewhere).
    """
    if metas is None:
        metas = [ShardMeta.load(p.with_suffix(".json")) for p in list_shards(directory)]
    masked = {m.masked for m in metas}
    if len(masked) > 1:
        raise ValueError(f"{directory}: some shards carry a loss mask and some do not; a source is all fine-tuning data or none")
    if masked == {True}:
        extra = {**extra, "masked": True, "trained_tokens": sum(m.trained_tokens for m in metas)}
    paired = {m.is_preference for m in metas}
    if len(paired) > 1:
        raise ValueError(f"{directory}: some shards hold preference pairs and some do not; a source is all pairs or none")
    if paired == {True}:
        extra = {**extra, "preference": True, "pairs": sum(m.pairs for m in metas)}
    prompts = {m.is_prompts for m in metas}
    if len(prompts) > 1:
        raise ValueError(f"{directory}: some shards hold RL prompts and some do not; a source is all prompts or none")
    if prompts == {True}:
        counts: dict[str, int] = {}
        for m in metas:
            for name, n in m.verifiers.items():
                counts[name] = counts.get(name, 0) + n
        extra = {**extra, "prompts": True, "verifiers": dict(sorted(counts.items()))}
    manifest = Manifest(
        num_tokens=sum(m.num_tokens for m in metas),
        num_docs=sum(m.num_docs for m in metas),
        shards=names or [m.bin for m in metas],
        dtype=dtype_for_vocab(tokenizer.vocab_size).name,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        tokenizer_fingerprint=tokenizer.fingerprint,
        extra={"split": split, "pad_id": tokenizer.pad_id, **extra},
    )
    manifest.save(directory)
    return manifest
