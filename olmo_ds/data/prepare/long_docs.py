"""Very long documents tokenized in pieces, with exactly the ids of tokenizing each one whole.

Why: a tokenizer's memory grows with its input. HF `tokenizers` keeps, per token, the id, the
token's string, its offsets and masks, and olmo-ds then a Python int: a 50 MB one-line document
took 7.1 GB. Blocks bound what one batch holds (`readers.CHUNK_BYTES`), but a document is never
cut by the reader, so a document longer than `PIECE_CHARS` is encoded here piece by piece, each
piece's ids kept as uint32 at once.

When that gives the same ids (`can_cut`): the pieces are cut where the tokenizer's pre-tokenizer
splits anyway, so that no pre-token, added token or normalisation spans a cut; BPE never merges
across pre-tokens. A cut is just before a space (U+0020) that follows a character which is not
whitespace (a letter, digit or ASCII symbol: `_CUT`). For the two pre-tokenizer patterns known
here (GPT-2's, which `ByteLevel` applies, and cl100k's, which dolma2 uses), no alternative
matches a non-whitespace character followed by a space, and none looks behind: so the text before
the cut splits as it does in the whole, and matching restarts at the space exactly as it does at
the start of the piece after it (whose leading space also means a `ByteLevel` prefix space is not
added). NFC/NFD normalisation never composes or reorders across a space. An added token could span
the cut only if it mixed whitespace with other characters (all-whitespace ones, like GPT-NeoX's
runs of spaces, start at the cut at most), or strip the space beside it (`lstrip`/`rstrip`).
Anything else (another pattern, a normaliser that rewrites spaces, BPE dropout, a sentencepiece
model) is encoded whole, as before: correct, with memory not bounded. `tests/data/test_long_docs.py`
checks the identity on real tokenizers and text.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import orjson

PIECE_CHARS = 1 << 20  # about what one block of many short documents encodes at once

# The pre-tokenizer patterns whose splits `can_cut` relies on (the module docstring says why).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
CL100K_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
KNOWN_PATTERNS = (GPT2_PATTERN, CL100K_PATTERN)

_CUT = re.compile(r"(?<=[!-~\w]) ")  # a space after an ASCII symbol, letter or digit: never whitespace

_decided: dict[str, str | None] = {}  # tokenizer.json path -> why not (None: pieces are exact), per process


def why_not_cut(tok) -> str | None:
    """None when `tok` gives the same ids for a text cut at `_CUT` spaces as for the whole; else
    the reason (the part of its tokenizer.json that rules it out)."""
    if tok.kind != "hf":
        return f"{tok.kind} models are encoded whole"
    key = str(tok.path)
    if key not in _decided:
        _decided[key] = _why_not(orjson.loads(Path(tok.path).read_bytes()))
    return _decided[key]


def _why_not(spec: dict) -> str | None:
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout"):
        return f"model {model.get('type')} (dropout {model.get('dropout')}): only BPE without dropout is known to cut exactly"
    normalizer = spec.get("normalizer")
    parts = (normalizer or {}).get("normalizers", [normalizer]) if (normalizer or {}).get("type") == "Sequence" else [normalizer]
    if any(n is not None and n.get("type") not in ("NFC", "NFD") for n in parts):
        return f"normalizer {normalizer}: only NFC/NFD (or none) are known to leave spaces alone"
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    splits = 0
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":
            splits += bool(step.get("use_regex", True))
        elif kind == "Split":
            pattern = (step.get("pattern") or {}).get("Regex")
            each_match_a_piece = (step.get("behavior"), bool(step.get("invert"))) in (("Isolated", False), ("Removed", True))
            if pattern not in KNOWN_PATTERNS or not each_match_a_piece:
                return f"pre-tokenizer Split {pattern!r} ({step.get('behavior')}, invert {step.get('invert')}) is not one known to split at spaces"
            splits += 1
        else:
            return f"pre-tokenizer {kind} is not one known to split at spaces"
    if not splits:
        return "the pre-tokenizer does not split the text at spaces"
    for t in spec.get("added_tokens") or []:
        content = t.get("content", "")
        if t.get("lstrip") or t.get("rstrip") or (any(c.isspace() for c in content) and not content.isspace()):
            return f"added token {content!r} could span a cut (whitespace with other characters, or lstrip/rstrip)"
    return None


def cuts(text: str, piece_chars: int = PIECE_CHARS) -> list[int]:
    """Where to cut `text` into pieces of at least `piece_chars` characters (the last may be shorter;
    longer ones where no `_CUT` space comes sooner): the first such space at or after each target."""
    out, start = [], 0
    while len(text) - start > piece_chars:
        m = _CUT.search(text, start + piece_chars)
        if m is None:
            break
        out.append(m.start())
        start = m.start()
    return out


def encode_documents(tok, texts: list[str], piece_chars: int = PIECE_CHARS) -> tuple[np.ndarray, np.ndarray]:
    """`tok.encode_batch_flat(texts)`, with every text longer than `piece_chars` encoded piece by
    piece where the tokenizer allows (`why_not_cut`): the same ids, in memory bounded by the piece."""
    if not any(len(t) > piece_chars for t in texts) or why_not_cut(tok) is not None:
        return tok.encode_batch_flat(texts)
    ids: list[np.ndarray] = []
    lens: list[int] = []
    short: list[str] = []

    def encode_short() -> None:
        if short:
            flat, offsets = tok.encode_batch_flat(short)
            ids.append(flat)
            lens.extend(np.diff(offsets).tolist())
            short.clear()

    for text in texts:
        if len(text) <= piece_chars:
            short.append(text)
            continue
        encode_short()
        n = 0
        bounds = [0, *cuts(text, piece_chars), len(text)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            flat, _ = tok.encode_batch_flat([text[a:b]])
            ids.append(np.array(flat, dtype=np.uint32))  # a copy: nothing of the piece's encoding stays alive
            n += len(flat)
        lens.append(n)
    encode_short()
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    return np.concatenate(ids).astype(np.uint32, copy=False), offsets
