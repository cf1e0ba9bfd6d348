"""One shard directory read as one long, memory-mapped token stream, cut into fixed-length instances.

Concatenate-and-chunk over the whole source: the shards of a source are concatenated in manifest
order and instance i is tokens [i * seq_len, (i + 1) * seq_len) of that stream. Instances may cross
document and shard boundaries; only the stream's one tail that does not fill a whole instance is
dropped (and counted, so the report says how much). This differs from OLMo-core's classic numpy
dataset, which cuts each file into instances separately and drops every file's tail, so the same
files give other instances there. The shards may be ours or OLMo's own token files registered in
place (`prepare/token_files.py`: the metadata's `bin` then points at the file). Nothing is copied at open time: shards are `np.memmap`s and an instance is
read straight from the page cache into the caller's batch buffer.

Every inconsistency the loader can detect without reading the data is raised here, naming the file,
before training starts: a missing shard, a truncated `.bin`, a document index that does not span its
shard, shards of different tokenizers or dtypes in one directory, and a sequence length that the
data cannot fill even once.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from olmo_ds.data import shards
from olmo_ds.data.shards import MANIFEST, Manifest, ShardMeta


@dataclass(frozen=True)
class ShardInfo:
    """What identifies a shard's content for the data fingerprint."""

    name: str
    num_tokens: int
    checksum: str


class TokenSource:
    """The concatenated token stream of one shard directory (see the module docstring)."""

    def __init__(self, path: str | Path, name: str | None = None) -> None:
        self.directory = Path(path)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"data source {self.directory}: no such directory (expected shards written by scripts/prepare_data.py)")
        self.name = name or self.directory.name
        self.manifest = Manifest.load(self.directory)
        manifest_file = self.directory / MANIFEST
        if not self.manifest.shards:
            raise ValueError(f"{manifest_file}: lists no shards")

        self.metas: list[ShardMeta] = []
        self.shard_info: list[ShardInfo] = []
        self._tokens: list[np.ndarray] = []
        self._offset_files: list[Path] = []
        for listed in self.manifest.shards:
            stem = listed[: -len(".bin")] if listed.endswith(".bin") else listed
            meta_file = self.directory / f"{stem}.json"
            if not meta_file.exists():
                raise FileNotFoundError(f"{meta_file}: missing; {manifest_file} lists shard {listed!r}")
            meta = ShardMeta.load(meta_file)
            bin_file = self.directory / meta.bin
            offsets_file = self.directory / meta.offsets
            for f in (bin_file, offsets_file):
                if not f.exists():
                    raise FileNotFoundError(f"{f}: missing; {manifest_file} lists shard {listed!r}")
            if meta.dtype != self.manifest.dtype:
                raise ValueError(f"{meta_file}: dtype {meta.dtype} differs from {self.manifest.dtype} in {manifest_file}; one source must hold shards of one dtype")
            if (meta.vocab_size, meta.eos_id) != (self.manifest.vocab_size, self.manifest.eos_id):
                raise ValueError(
                    f"{meta_file}: vocab_size {meta.vocab_size}, eos_id {meta.eos_id} differ from {manifest_file} "
                    f"(vocab_size {self.manifest.vocab_size}, eos_id {self.manifest.eos_id}): shards of different tokenizers in one source"
                )
            if meta.max_token_id >= meta.vocab_size:
                raise ValueError(f"{meta_file}: max_token_id {meta.max_token_id} >= vocab_size {meta.vocab_size}; the shard is corrupt or mislabelled")
            self._tokens.append(shards.open_tokens(bin_file, meta))  # raises on a truncated .bin
            self._offset_files.append(offsets_file)
            self.metas.append(meta)
            # The listed name, not `meta.bin`: the same for shards we wrote, and for in-place token files
            # (`prepare/token_files.py`, `bin` an absolute path) it keeps the fingerprint independent of where they live.
            self.shard_info.append(ShardInfo(listed, meta.num_tokens, meta.checksum))

        sizes = np.array([m.num_tokens for m in self.metas], dtype=np.int64)
        self.num_tokens = int(sizes.sum())
        if self.num_tokens != self.manifest.num_tokens:
            raise ValueError(f"{manifest_file}: num_tokens {self.manifest.num_tokens} != {self.num_tokens}, the sum over its shards' metadata")
        # starts[k] is the stream position of shard k's first token; starts[-1] == num_tokens.
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.max_token_id = max(m.max_token_id for m in self.metas)
        # Memory-mapped and checked now, so a broken index fails before step one, not at the first batch.
        self._offsets = [self._load_offsets(k) for k in range(len(self.metas))]

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    @property
    def eos_id(self) -> int:
        return self.manifest.eos_id

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.manifest.tokenizer_fingerprint

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.manifest.dtype)

    def num_instances(self, seq_len: int) -> int:
        """How many whole instances of `seq_len` tokens the stream holds; raises if not even one."""
        n = self.num_tokens // seq_len
        if n == 0:
            raise ValueError(f"data source {self.directory}: {self.num_tokens} tokens cannot fill even one instance of seq_len {seq_len}")
        return n

    def fingerprint_record(self) -> dict:
        """The identity of this source's data: shard names, sizes, checksums and the tokenizer."""
        return {
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "shards": [[s.name, s.num_tokens, s.checksum] for s in self.shard_info],
        }

    def fingerprint(self) -> str:
        blob = json.dumps(self.fingerprint_record(), sort_keys=True).encode()
        return "sha256:" + hashlib.sha256(blob).hexdigest()

    def read(self, start: int, out: np.ndarray) -> None:
        """Copy tokens [start, start + len(out)) of the stream into `out`, across shard boundaries."""
        end = start + len(out)
        if start < 0 or end > self.num_tokens:
            raise IndexError(f"data source {self.directory}: tokens [{start}, {end}) outside the stream of {self.num_tokens}")
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        pos, filled = start, 0
        while filled < len(out):
            local = pos - int(self.starts[k])
            take = min(len(out) - filled, int(self.starts[k + 1]) - pos)
            out[filled : filled + take] = self._tokens[k][local : local + take]
            filled += take
            pos += take
            k += 1

    def doc_lengths(self, start: int, length: int) -> np.ndarray:
        """Lengths of the document pieces that tokens [start, start + length) are cut into.

        Read from the shards' offsets index, not by scanning for EOS: a document that began before
        `start` or continues past the end counts only with its part inside the window. Shard ends
        are document ends too (a document never spans shards).
        """
        end = start + length
        cuts = [start]
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        while k < len(self.metas) and int(self.starts[k]) < end:
            base = int(self.starts[k])
            offs = self._offsets[k]
            lo = int(np.searchsorted(offs, start - base, side="right"))
            hi = int(np.searchsorted(offs, end - base, side="left"))
            cuts.extend((base + offs[lo:hi]).tolist())
            k += 1
        cuts.append(end)
        # A shard's end and the next shard's start are the same cut; unique() merges them.
        return np.diff(np.unique(np.asarray(cuts, dtype=np.int64)))

    def _load_offsets(self, k: int) -> np.ndarray:
        path = self._offset_files[k]
        offs = shards.load_offsets(path)
        meta = self.metas[k]
        if offs.ndim != 1 or len(offs) != meta.num_docs + 1 or offs[0] != 0 or offs[-1] != meta.num_tokens:
            raise ValueError(
                f"{path}: expected {meta.num_docs + 1} offsets from 0 to {meta.num_tokens}, "
                f"got {len(offs)} from {offs[0] if len(offs) else None} to {offs[-1] if len(offs) else None}"
            )
        return offs
