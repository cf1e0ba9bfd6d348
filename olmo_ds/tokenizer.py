"""One tokenizer interface over HF `tokenizers` (`tokenizer.json`) and sentencepiece (`.model`).

Data preparation, training and evaluation must agree on the ids, the EOS id and the vocabulary size,
and must be able to prove that two runs used the same tokenizer: hence `fingerprint`, a sha256 of what
decides the ids (`content_fingerprint`), not of how a library wrote the file, so a tokenizer.json
re-saved by transformers or a newer `tokenizers` keeps it. Shards and checkpoints written before
recorded a hash of the whole file (`legacy_fingerprint`); `matches` accepts either, so they keep
working. `encode` never adds special tokens: data preparation appends EOS itself, so it is explicit.

An HF tokenizer.json has two encoders: HF `tokenizers` itself, the reference every other part of
the project uses, and `fastokens` (`backend="fast"`), which reads the same file and returns the
same ids an order of magnitude faster. Data preparation uses the fast one only after checking it
against the reference on its own input and on `ADVERSARIAL_TEXTS` (`first_difference`).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np
import orjson

from olmo_ds import hub
from olmo_ds.fast_parse import FastParse, single_thread_fast

# Names under which tokenizers in the wild spell their end-of-document and padding tokens, in the
# order we prefer them when no tokenizer_config.json names them.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")
PAD_CANDIDATES = ("<|pad|>", "<|padding|>", "<pad>", "[PAD]")


class Tokenizer(ABC):
    """The interface every backend implements (see docs/architecture.md, "Tokenizer")."""

    path: Path
    vocab_size: int  # number of ids = max id + 1 (ids are dense in [0, vocab_size))
    eos_id: int
    pad_id: int | None
    fingerprint: str  # "sha256:<hex>" of what decides the ids (`content_fingerprint`)
    legacy_fingerprint: str  # what shards and checkpoints recorded before: "sha256:<hex>" of the whole file's JSON
    kind: str  # "hf" | "sentencepiece": the file format
    backend: str  # the library that encodes: "tokenizers" | "fastokens" | "sentencepiece"

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def encode_batch_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """All ids of a batch in one uint32 array, and int64 offsets (len(texts) + 1) into it:
        the form bulk tokenization wants, without a Python int per token where the backend allows."""
        batch = self.encode_batch(texts)
        offsets = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum([len(ids) for ids in batch], out=offsets[1:])
        return np.array(list(itertools.chain.from_iterable(batch)), dtype=np.uint32), offsets

    @abstractmethod
    def decode(self, ids) -> str: ...

    @abstractmethod
    def token_to_id(self, token: str) -> int | None: ...

    @abstractmethod
    def configured_token(self, key: str) -> str | None: ...

    def matches(self, recorded: str | None) -> bool:
        """Whether `recorded` (a manifest's or checkpoint's tokenizer fingerprint) names this tokenizer, in the
        current form or the legacy one that files written before carry."""
        if recorded is None:
            return False
        # One fingerprint at a time: the legacy one costs a canonical re-serialisation of the whole file (~0.3 s for
        # dolma2), which a current file's match never needs.
        return (recorded == self.fingerprint or LEGACY_CONTENT.get(recorded) == self.fingerprint
                or recorded == self.legacy_fingerprint)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id}, pad_id={self.pad_id})"


class HFTokenizer(Tokenizer):
    """A `tokenizers` `tokenizer.json`. Batch encoding uses `encode_batch_fast` (no offsets)."""

    kind = "hf"
    backend = "tokenizers"

    def __init__(self, path: Path):
        import tokenizers

        self.path = Path(path)
        self._raw = self.path.read_bytes()
        try:
            self._tok = tokenizers.Tokenizer.from_str(self._raw.decode("utf-8"))
        except Exception as e:  # the library's own message names the part it could not parse
            raise ValueError(f"{self.path}: not a valid HF tokenizer.json: {e}") from e
        self.vocab_size = self._max_id() + 1
        self._config = _read_tokenizer_config(self.path.parent)

    @functools.cached_property
    def _content(self) -> dict:
        """The tokenizer.json parsed once (~0.1 s for dolma2's 7 MB) for the max id and both fingerprints."""
        return orjson.loads(self._raw)

    def _max_id(self) -> int:
        # Reading the ids from the JSON is several times faster than get_vocab()'s 100k-entry dict.
        content = self._content
        vocab = content.get("model", {}).get("vocab")
        if not isinstance(vocab, dict):  # Unigram's list of [piece, score], or an unusual model
            return max(self._tok.get_vocab(with_added_tokens=True).values())
        return max([*vocab.values(), *(t["id"] for t in content.get("added_tokens") or [])])

    # Both computed on first use: data preparation workers load the tokenizer but never need them.
    @functools.cached_property
    def fingerprint(self) -> str:
        return content_fingerprint(self._content)

    @functools.cached_property
    def legacy_fingerprint(self) -> str:
        # The whole file as canonical JSON (sorted keys, no whitespace): what olmo-ds recorded until issue 36.
        canonical = orjson.dumps(self._content, option=orjson.OPT_SORT_KEYS)
        return "sha256:" + hashlib.sha256(canonical).hexdigest()

    @property
    def split_special_tokens(self) -> bool:
        """Whether the text of a special token inside the input (a web page quoting "<|endoftext|>")
        encodes as ordinary text; by default HF matches it as the special token, so an EOS id could
        land inside a document. Other text encodes the same either way."""
        return self._tok.encode_special_tokens

    @split_special_tokens.setter
    def split_special_tokens(self, on: bool) -> None:
        self._tok.encode_special_tokens = on

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def configured_token(self, key: str) -> str | None:
        """`eos_token`/`pad_token` from a tokenizer_config.json beside the tokenizer.json, if any."""
        value = self._config.get(key)
        if isinstance(value, dict):  # transformers serializes AddedToken as {"content": ...}
            value = value.get("content")
        return value if isinstance(value, str) else None


class FastBackendError(Exception):
    """The fast library cannot load this tokenizer (a feature it lacks); the reference still can."""


class FastHFTokenizer(HFTokenizer):
    """The same tokenizer.json encoded by `fastokens`; everything but encoding stays HF's.

    `fastokens` starts a helper thread per batch unless told otherwise; data preparation runs one
    process per core, so `single_thread` pins it to the calling thread (set before first use).
    """

    backend = "fastokens"

    def __init__(self, path: Path, single_thread: bool = True, reference: HFTokenizer | None = None, parse: FastParse | None = None):
        if reference is None:
            super().__init__(path)
        else:  # share an already loaded HF tokenizer of the same file (parsing it again costs ~0.2 s)
            self.__dict__.update(reference.__dict__)
        if single_thread:
            single_thread_fast()
        try:
            if parse is not None:  # fastokens parsing this file already, in a thread of its own (`fast_parse`)
                self._fast = parse.result()
            else:
                import fastokens

                self._fast = fastokens.Tokenizer.from_json_str(self._raw.decode("utf-8"))
        except ImportError:
            raise
        except Exception as e:  # fastokens raises plain exceptions naming the unsupported part
            raise FastBackendError(f"{self.path}: fastokens cannot load it: {e}") from e

    # `split_special_tokens` (HFTokenizer's, the same flag as the reference it shares `_tok` with)
    # is passed on, so both encoders treat special-token text alike and the guard can compare them.
    def encode(self, text: str) -> list[int]:
        return list(self._fast.encode(text, add_special_tokens=False, split_special_tokens=self.split_special_tokens).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        flat, offsets = self.encode_batch_flat(texts)
        return [flat[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]

    def encode_batch_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        ids, offsets = self._fast.encode_batch_flat(list(texts), add_special_tokens=False, split_special_tokens=self.split_special_tokens)
        return np.frombuffer(ids, dtype="<u4"), np.frombuffer(offsets, dtype="<u8").astype(np.int64)


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece `.model`; its EOS/PAD ids come from the model's own trainer settings."""

    kind = "sentencepiece"
    backend = "sentencepiece"

    def __init__(self, path: Path):
        import sentencepiece as spm

        self.path = Path(path)
        raw = self.path.read_bytes()
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=raw)
        except Exception as e:
            raise ValueError(f"{self.path}: not a valid sentencepiece model: {e}") from e
        # The serialized ModelProto is the canonical content (it always was: the legacy form is the same).
        self.fingerprint = self.legacy_fingerprint = "sha256:" + hashlib.sha256(self._sp.serialized_model_proto()).hexdigest()
        self.vocab_size = self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])

    def token_to_id(self, token: str) -> int | None:
        i = self._sp.piece_to_id(token)
        return None if i == self._sp.unk_id() and token != self._sp.id_to_piece(i) else i

    def configured_token(self, key: str) -> str | None:
        i = {"eos_token": self._sp.eos_id(), "pad_token": self._sp.pad_id()}.get(key, -1)
        return self._sp.id_to_piece(i) if i >= 0 else None


# Options of a tokenizer.json model that change ids, at the value `tokenizers` takes when the file leaves them
# out: a writer that spells the default (newer `tokenizers` write `"ignore_merges": false`) means the same.
_MODEL_DEFAULTS = {
    "BPE": {"dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
            "fuse_unk": False, "byte_fallback": False, "ignore_merges": False},
    "Unigram": {"unk_id": None, "byte_fallback": False},
    "WordPiece": {"unk_token": "[UNK]", "continuing_subword_prefix": "##", "max_input_chars_per_word": 100},
    "WordLevel": {"unk_token": None},
}
_ADDED_TOKEN_DEFAULTS = {"single_word": False, "lstrip": False, "rstrip": False, "special": False}
# The legacy fingerprints (file hashes) of the tokenizers olmo-ds data is usually prepared with, and the content
# fingerprint each stands for. A file hash cannot be traced back to content, so without this table shards
# prepared before issue 36 match only a file with the same JSON; with it, shards made with dolma2 also match
# dolma2 as another writer saved it (a released model's tokenizer.json). tests/data/test_tokenizer.py keeps it true.
LEGACY_CONTENT = {
    # allenai/dolma2-tokenizer (OLMo 2 and OLMo 3)
    "sha256:1b392b8638e97bd38e9447f2fb9c48132bca818f211f25f8c1f21fdbe82d3f3a":
        "sha256:c2cb00be8b54e55620a08070d19b24d660249115d9a56bb40fd47795362d14cc",
    # allenai/gpt-neox-olmo-dolma-v1_5 (OLMo 1)
    "sha256:c71ca47cdd20b01573afcf7a3f99674c8f7052fbeb03a333945174daa8e9ecdb":
        "sha256:fc4512388894b72f53ea4e8cb23b5311b847b282b03636fb92cc53a4f9109263",
}
CONTENT_SCHEME = "olmo-ds tokenizer content 1"  # hashed with the content: a later rule cannot collide with this one


def content_fingerprint(content: dict) -> str:
    """"sha256:<hex>" of what decides the ids `encode` returns for a tokenizer.json's parsed `content`.

    Hashed: the model (its type, vocabulary with ids, merges in rank order, and the options that change ids),
    the normalizer, the pre-tokenizer, every added token with its id and matching flags, and truncation and
    padding (both change what encode returns when set). Not hashed: the post-processor, because olmo-ds always
    encodes with `add_special_tokens=False`, and then no `tokenizers` post-processor changes an id (Template,
    Bert and Roberta processing add their special tokens only when asked; ByteLevel's trims offsets, not ids);
    the decoder (text from ids, not ids); the file's `version` and layout. Serialisation is normalised: merges
    as "a b" strings or ["a", "b"] pairs, model options and added-token flags left out or spelled at their
    defaults, ByteLevel's `use_regex` (default true) and `trim_offsets` (offsets only).
    """
    model = dict(content.get("model") or {})
    for key, default in _MODEL_DEFAULTS.get(model.get("type"), {}).items():
        model.setdefault(key, default)
    if isinstance(model.get("merges"), list):
        model["merges"] = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in model["merges"]]
    added = [{**_ADDED_TOKEN_DEFAULTS, "normalized": not t.get("special", False), **t}
             for t in content.get("added_tokens") or []]
    canonical = {
        "scheme": CONTENT_SCHEME,
        "model": model,
        "normalizer": _without_layout(content.get("normalizer")),
        "pre_tokenizer": _without_layout(content.get("pre_tokenizer")),
        "added_tokens": sorted(added, key=lambda t: (t.get("id", -1), t.get("content", ""))),
        "truncation": content.get("truncation"),
        "padding": content.get("padding"),
    }
    return "sha256:" + hashlib.sha256(orjson.dumps(canonical, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _without_layout(component):
    """A normalizer or pre-tokenizer with ByteLevel's serialisation differences removed (recursively, for Sequence)."""
    if isinstance(component, list):
        return [_without_layout(c) for c in component]
    if not isinstance(component, dict):
        return component
    out = {k: _without_layout(v) for k, v in component.items()}
    if out.get("type") == "ByteLevel":
        out.setdefault("use_regex", True)
        out.pop("trim_offsets", None)
    return out


def same_tokenizer(a: "Tokenizer | str | None", b: "Tokenizer | str | None") -> bool:
    """Whether two tokenizers, or a tokenizer and a recorded fingerprint, or two recorded fingerprints, name the
    same tokenizer: the one rule every comparison uses. A loaded tokenizer also matches its legacy fingerprint
    (what shards and checkpoints written before recorded); two recorded strings must be equal."""
    if isinstance(a, Tokenizer) and isinstance(b, Tokenizer):
        return a.fingerprint == b.fingerprint
    if isinstance(a, Tokenizer):
        return a.matches(b)
    if isinstance(b, Tokenizer):
        return b.matches(a)
    return a is not None and b is not None and canonical_fingerprint(a) == canonical_fingerprint(b)


def canonical_fingerprint(recorded: str) -> str:
    """A recorded fingerprint in the current form where it is one of the known tokenizers' legacy file hashes
    (`LEGACY_CONTENT`); otherwise as recorded. Two recordings of one tokenizer, made before and after issue 36,
    compare equal through it without the tokenizer file at hand."""
    return LEGACY_CONTENT.get(recorded, recorded)


def _read_tokenizer_config(directory: Path) -> dict:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from e


def resolve_path(spec: str | Path) -> Path:
    """The tokenizer file `load_tokenizer` loads for `spec` (a file, a directory holding one, a hub id)."""
    path = Path(spec)
    if not path.exists() and hub.parse_hub_id(str(spec)) is not None:
        return hub.resolve_file(str(spec), "tokenizer.json")  # e.g. allenai/dolma2-tokenizer, through the HF cache
    if path.is_dir():
        candidate = path / "tokenizer.json"
        if candidate.is_file():
            return candidate
        models = sorted(path.glob("*.model"))
        if len(models) == 1:
            return models[0]
        raise FileNotFoundError(f"{path}: directory holds no tokenizer.json (nor exactly one sentencepiece .model)")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: tokenizer file not found (expected an HF tokenizer.json, a directory holding one, a sentencepiece .model, "
                                f"or a Hugging Face hub id such as allenai/dolma2-tokenizer)")
    return path


def _find_token(tok: Tokenizer, configured: str | None, candidates: tuple[str, ...]) -> int | None:
    for name in ((configured,) if configured else ()) + candidates:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    return None


def fast_beside(reference: HFTokenizer, single_thread: bool = True, parse: FastParse | None = None) -> FastHFTokenizer:
    """`reference` (an `HFTokenizer` from `load_tokenizer`) encoded with `fastokens`: the same file,
    EOS and PAD, without parsing the tokenizer.json with HF again. `parse`: fastokens already parsing
    that file in a thread (`fast_parse.FastParse`), waited for. Raises `FastBackendError` if fastokens
    cannot load it, `ImportError` without fastokens."""
    return FastHFTokenizer(reference.path, single_thread, reference=reference, parse=parse)


def load_tokenizer(path, eos_token: str | None = None, backend: str = "hf") -> Tokenizer:
    """Load an HF tokenizer.json (or a directory holding one), a sentencepiece .model, or the
    tokenizer.json of a Hugging Face hub repo (`allenai/dolma2-tokenizer`, through the HF cache;
    see olmo_ds/hub.py). `.path` is then the cached file.

    The EOS id is `eos_token`'s id when given, else the tokenizer's own (tokenizer_config.json's
    `eos_token`, the sentencepiece model's eos, or a conventional name such as `<|endoftext|>`).
    A tokenizer without an identifiable EOS is refused: documents could not be separated.
    `backend="fast"` encodes an HF tokenizer.json with `fastokens` (raises `FastBackendError` if it
    cannot); a sentencepiece model always uses its own encoder.
    """
    if backend not in ("hf", "fast"):
        raise ValueError(f"tokenizer backend {backend!r}: expected 'hf' or 'fast'")
    path = resolve_path(path)
    tok: Tokenizer
    if path.suffix == ".model":
        tok = SentencePieceTokenizer(path)
    else:
        tok = FastHFTokenizer(path) if backend == "fast" else HFTokenizer(path)
    if eos_token is not None:
        eos = tok.token_to_id(eos_token)
        if eos is None:
            raise ValueError(f"{path}: --eos-token {eos_token!r} is not in the tokenizer's vocabulary")
    else:
        eos = _find_token(tok, tok.configured_token("eos_token"), EOS_CANDIDATES)
        if eos is None:
            raise ValueError(f"{path}: the tokenizer has no recognizable EOS token (tried {', '.join(EOS_CANDIDATES)}); name one with --eos-token")
    tok.eos_id = eos
    tok.pad_id = _find_token(tok, tok.configured_token("pad_token"), PAD_CANDIDATES)
    return tok


EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def train_bpe_tokenizer(texts, vocab_size: int, output: Path, min_frequency: int = 2, special_tokens: list[str] = ()) -> Tokenizer:
    """Train a byte-level BPE `tokenizer.json` (GPT-2 style pre-tokenization) on an iterable of texts.

    Byte-level means every string is encodable (no unknown token). The special tokens EOS
    `<|endoftext|>` and PAD `<|pad|>` take ids 0 and 1, then `special_tokens` (a chat template's markers,
    e.g. `<|im_start|>` and `<|im_end|>` for OLMo 3's) the ids after them, each one id that ordinary text
    never produces; `vocab_size` counts them all and the 256 bytes.
    """
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    specials = list(dict.fromkeys([EOS_TOKEN, PAD_TOKEN, *special_tokens]))
    if any(not t or t.isspace() for t in specials):
        raise ValueError(f"--special-tokens: a special token must be non-blank text, got {[t for t in specials if not t or t.isspace()]!r}")
    minimum = len(specials) + 256
    if vocab_size < minimum:
        raise ValueError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least {minimum} (256 bytes + {len(specials)} special tokens)")
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(output))
    return load_tokenizer(output)


# Text that breaks tokenizers that are almost right: literal special-token text, whitespace runs
# long enough to hit GPT-NeoX's added whitespace tokens, text that NFC normalization changes, mixed
# scripts, emoji sequences, control and invisible characters, digit runs, and very long words and
# documents. A fast backend must agree with HF tokenizers on every one before it is used. (Lone
# surrogates are not here: no encoder accepts them, and the readers skip them as invalid UTF-8.)
ADVERSARIAL_TEXTS = [
    "<|endoftext|>", "a<|endoftext|>b", "x <|pad|> <|padding|> y", "<|im_start|>user\nhi<|im_end|>",
    "|||PHONE_NUMBER||| |||EMAIL_ADDRESS||| |||IP_ADDRESS|||", "<|endoftext", "<|extra_id_0|><|fim_prefix|>",
    *(" " * n + "x" for n in range(1, 41)), "x" + " " * 24, "\t" * 30 + "y", "\n" * 50, "a \n\n  \t \r\n b",
    "e\u0301 cafe\u0301 caf\u00e9", "\u212b \u00c5 A\u030a", "\ufb01 \u1100\u1161\u11a8 \uac01", "\uff26\uff55\uff4c\uff4c",
    "Hello мир 世界 مرحبا שלום नमस्ते ελληνικά 日本語のテキスト", "👨‍👩‍👧‍👦 🏳️‍🌈 🇺🇸🇫🇷 👍🏽 ❤️",
    "\u200b\ufeff\x00\x01\x7f\u202e abc \u2028 \u00a0", "x\r\ny\r\n", "'s 't 're 've 'm 'll 'd 'S 'LL",
    "1234567890" * 50, "१२३ ٣٤٥ ０１２", "a" * 20000, "Aa1!" * 5000,
    "def f(x):\n\tif x:\n\t\treturn {'k': [1, 2]}  # комментарий\n" * 200,
    "".join(chr(c) for c in range(0x20, 0x3000, 7)),
]


def first_difference(candidate: Tokenizer, reference: Tokenizer, texts: list[str], labels: list[str]) -> str | None:
    """None if `candidate` gives `reference`'s ids for every text, else where and how they first differ."""
    got, got_off = candidate.encode_batch_flat(texts)
    want, want_off = reference.encode_batch_flat(texts)
    if np.array_equal(got_off, want_off) and np.array_equal(got, want):
        return None
    for i, label in enumerate(labels):
        a, b = got[got_off[i] : got_off[i + 1]], want[want_off[i] : want_off[i + 1]]
        if not np.array_equal(a, b):
            n = min(len(a), len(b))
            k = int(np.argmax(a[:n] != b[:n])) if n and np.any(a[:n] != b[:n]) else n
            return f"{label}: ids differ from token {k} ({a[k:k + 4].tolist()} vs HF's {b[k:k + 4].tolist()})"
    raise AssertionError("flat outputs differ but no document does")
