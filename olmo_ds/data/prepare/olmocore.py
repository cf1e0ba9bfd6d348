"""Masked shards → open-instruct's OLMo-core SFT layout, which OLMo-core's SFT scripts read.

The layout (shared/docs/SFT-FORMATS.md §3; open-instruct `open_instruct/numpy_dataset_conversion.py`):

- `token_ids_part_XXXX.npy`: the conversations' ids concatenated, a raw little-endian memmap with no
  `.npy` header, dtype the smallest of uint8/16/32/64 that holds `vocab_size - 1` (uint32 for OLMo);
- `labels_mask_part_XXXX.npy`: the loss mask, raw `np.bool_`, one byte per token (1 = trained);
- `token_ids_part_XXXX.csv.gz`: `start,end` per conversation (end exclusive), relative to the part,
  no header;
- a new part every `part_bytes` (1 GiB) of token ids, as the converter cuts them: a conversation that
  crosses the cut is split there, and each part's `.csv.gz` lists the (clipped) conversations that
  overlap it;
- `tokenizer/`: the tokenizer.json and a `tokenizer_config.json` holding the `chat_template` (and the
  special tokens) where the source's manifest names the template, `chat_template.jinja` beside it;
- `dataset_statistics.json` / `.txt`: instances, tokens, trainable tokens.

Order: the shards' document order (input order), or `shuffle_seed`'s permutation — the converter
shuffles rows with `numpy.random.default_rng(seed).permutation(n)` (`datasets`' `shuffle(seed=42)`,
its default), so `shuffle_seed=42` gives its order. Conversations are copied as they are (a truncated
one keeps its missing EOS, as the converter leaves it). Every file is written atomically, so a killed
export leaves no file that looks whole; an existing, non-empty output is refused.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
from pathlib import Path

import numpy as np

import olmo_ds
from olmo_ds.atomic import atomic_write_bytes
from olmo_ds.chat import load_chat_template
from olmo_ds.data import shards

PART_BYTES = 1 << 30  # the converter's part size: 1 GiB of token ids


class ExportError(ValueError):
    """A source that cannot be exported, or an output that must not be touched; names it."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The converter's rule: the smallest unsigned integer that holds `vocab_size - 1`."""
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        if vocab_size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt).newbyteorder("<")
    raise ExportError(f"vocab size {vocab_size} fits no unsigned integer dtype")


def _deterministic_gzip(text: str) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as f:
        f.write(text.encode("utf-8"))
    return buf.getvalue()


class _Source:
    """A masked shard directory's documents, by global index, read through the shards' offsets."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        try:
            self.manifest = shards.Manifest.load(self.directory)
        except (OSError, ValueError) as e:
            raise ExportError(str(e)) from e
        if not self.manifest.masked:
            raise ExportError(f"{self.directory}: its shards carry no loss mask (not `masked` in {shards.MANIFEST}); "
                              "prepare conversations with prepare_data.py --format chat first")
        self.metas, self.tokens, self.masks, starts = [], [], [], []
        self.offsets = []
        for name in self.manifest.shards:
            meta = shards.ShardMeta.load((self.directory / name).with_suffix(".json"))
            self.metas.append(meta)
            self.tokens.append(shards.open_tokens(self.directory / meta.bin, meta))
            self.masks.append(shards.open_mask(self.directory / meta.mask, meta))
            self.offsets.append(np.asarray(shards.load_offsets(self.directory / meta.offsets), dtype=np.int64))
        counts = np.array([m.num_docs for m in self.metas], dtype=np.int64)
        self.first_doc = np.concatenate([[0], np.cumsum(counts)])
        self.num_docs = int(self.first_doc[-1])
        self.lengths = np.concatenate([np.diff(o) for o in self.offsets]) if self.offsets else np.zeros(0, np.int64)

    def document(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        s = int(np.searchsorted(self.first_doc, k, side="right") - 1)
        d = k - int(self.first_doc[s])
        a, b = self.offsets[s][d], self.offsets[s][d + 1]
        return self.tokens[s][a:b], self.masks[s][a:b]


def export_olmocore(source: Path, output: Path, tokenizer=None, shuffle_seed: int | None = None, part_bytes: int = PART_BYTES) -> dict:
    """Write `source` (a masked shard directory) to `output` in the OLMo-core SFT layout (module docstring).
    `tokenizer`: the loaded tokenizer, for `tokenizer/` (default: the one the manifest names, if it exists).
    Returns the overall statistics."""
    src = _Source(source)
    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--output {out}: exists and is not an empty directory; export into a new one (nothing was changed)")
    m = src.manifest
    dtype = token_dtype(m.vocab_size)
    order = np.arange(src.num_docs) if shuffle_seed is None else np.random.default_rng(shuffle_seed).permutation(src.num_docs)
    part_tokens = max(part_bytes // dtype.itemsize, 1)
    out.mkdir(parents=True, exist_ok=True)

    parts: list[int] = []
    ids_buf, mask_buf, bounds, filled = [], [], [], 0
    total = trained = 0

    def close_part():
        nonlocal ids_buf, mask_buf, bounds, filled
        k = len(parts)
        ids = np.concatenate(ids_buf).astype(dtype, copy=False) if ids_buf else np.zeros(0, dtype)
        mask = np.concatenate(mask_buf).astype(bool, copy=False) if mask_buf else np.zeros(0, bool)
        atomic_write_bytes(out / f"token_ids_part_{k:04d}.npy", ids.tobytes())
        atomic_write_bytes(out / f"labels_mask_part_{k:04d}.npy", shards.mask_bytes(mask))
        atomic_write_bytes(out / f"token_ids_part_{k:04d}.csv.gz", _deterministic_gzip("".join(bounds)))
        parts.append(k)
        ids_buf, mask_buf, bounds, filled = [], [], [], 0

    for k in order.tolist():
        ids, mask = src.document(int(k))
        total += len(ids)
        trained += int(np.count_nonzero(mask))
        at = 0
        while at < len(ids):  # a conversation crossing the part's end is split there, as the converter cuts
            take = min(len(ids) - at, part_tokens - filled)
            ids_buf.append(np.asarray(ids[at:at + take]))
            mask_buf.append(np.asarray(mask[at:at + take]))
            bounds.append(f"{filled},{filled + take}\n")
            filled += take
            at += take
            if filled == part_tokens:
                close_part()
    if filled or not parts:
        close_part()

    _write_tokenizer_dir(out / "tokenizer", m, tokenizer)
    stats = _write_statistics(out, src, m, total, trained, shuffle_seed)
    return stats


def _write_tokenizer_dir(directory: Path, m: shards.Manifest, tokenizer) -> None:
    """tokenizer.json and a tokenizer_config.json with the chat template, as `save_pretrained` leaves them
    (the fields OLMo-core and transformers read: the template, the special tokens)."""
    directory.mkdir(exist_ok=True)
    path = Path(tokenizer.path) if tokenizer is not None else Path(m.extra.get("arguments", {}).get("tokenizer") or m.extra.get("source", {}).get("tokenizer", ""))
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ExportError(f"{path}: the source's tokenizer is not there; pass --tokenizer")
    shutil.copyfile(path, directory / "tokenizer.json")
    chat = m.extra.get("chat") or {}
    config: dict = {}
    template_text = None
    if chat.get("template"):
        try:
            template = load_chat_template(chat["template"], tokenizer)
        except (OSError, ValueError):
            template = None
        if template is not None and "sha256:" + hashlib.sha256(template.text.encode("utf-8")).hexdigest() == chat.get("template_sha256"):
            template_text = template.text
            config.update(template.tokens)
    if template_text is not None:
        config["chat_template"] = template_text
        (directory / "chat_template.jinja").write_text(template_text, encoding="utf-8")
    tok = json.loads(path.read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {str(t["id"]): {k: t.get(k) for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
                                      for t in tok.get("added_tokens") or []}
    config.setdefault("eos_token", None if tokenizer is None else tokenizer.decode([m.eos_id]))
    config["clean_up_tokenization_spaces"] = False
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    special = {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if config.get(k)}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")


def _write_statistics(out: Path, src: _Source, m: shards.Manifest, total: int, trained: int, seed: int | None) -> dict:
    n = src.num_docs
    skipped = sum(m.extra.get("skipped", {}).get("counts", {}).values())
    name = str(src.directory)
    per = {"dataset_name": name, "dataset_split": m.extra.get("split", "train"), "initial_instances": n + skipped,
           "instances_after_transformation": n, "instances_filtered_during_transformation": skipped, "frac_or_num_samples": 1.0,
           "original_dataset_size": n + skipped, "is_upsampled": False, "upsampling_factor": 1.0, "final_instances_in_output": n,
           "final_tokens_in_output": total, "final_trainable_tokens_in_output": trained, "instances_filtered_after_tokenization": 0,
           "avg_tokens_per_instance": total / n if n else 0.0, "percentage_of_total_tokens": 100.0, "percentage_of_total_instances": 100.0}
    chat = m.extra.get("chat") or {}
    overall = {"total_datasets": 1, "total_instances": n, "total_tokens": total, "trainable_tokens": trained,
               "trainable_percentage": trained / total * 100 if total else 0.0, "instances_filtered": skipped,
               "average_sequence_length": total / n if n else 0.0}
    stats = {"output_directory": str(out), "configuration": {"tokenizer": m.extra.get("arguments", {}).get("tokenizer"),
             "max_sequence_length": chat.get("max_tokens"), "chat_template": chat.get("template"), "shuffle_seed": seed,
             "exported_by": f"olmo-ds export_olmocore_sft {olmo_ds.__version__}"},
             "per_dataset_statistics": [per], "overall_statistics": overall}
    atomic_write_bytes(out / "dataset_statistics.json", (json.dumps(stats, indent=2) + "\n").encode())
    text = ["Dataset Statistics Report", "=" * 80, f"Output Directory: {out}", "", "Overall Statistics:", "=" * 80,
            f"- Total instances: {n:,}", f"- Total tokens: {total:,}",
            f"- Trainable tokens: {trained:,} ({overall['trainable_percentage']:.1f}%)", f"- Instances filtered out: {skipped}",
            f"- Average sequence length: {overall['average_sequence_length']:.1f}"]
    atomic_write_bytes(out / "dataset_statistics.txt", ("\n".join(text) + "\n").encode())
    return overall
