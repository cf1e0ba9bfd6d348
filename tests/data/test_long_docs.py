"""Very long documents are tokenized in pieces with the ids of tokenizing them whole
(olmo_ds/data/prepare/long_docs.py), on the real tokenizers and real text."""

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import tokenizers

from olmo_ds.data import shards
from olmo_ds.data.prepare import long_docs
from olmo_ds.data.prepare.long_docs import cuts, encode_documents, why_not_cut
from olmo_ds.data.prepare.pipeline import PrepareConfig, prepare
from olmo_ds.tokenizer import ADVERSARIAL_TEXTS, load_tokenizer
from olmo_ds.tools import package_env
from testdata import SHARED
from tests.data.test_prepare import DOLMA2, NEOX, c4_texts, read_all

CHAT = SHARED / "data" / "chat-sample" / "train.jsonl"


def real_text() -> str:
    """c4 web text, chat turns (other languages and code among them), and the adversarial texts the
    fast backend is checked on, shuffled into one document with every kind of whitespace between."""
    parts = c4_texts() + [m["content"] for line in CHAT.read_text().splitlines() for m in json.loads(line).get("messages", [])] + ADVERSARIAL_TEXTS
    random.Random(0).shuffle(parts)
    seps = [" ", "  ", "\n", "\n\n", " \n ", "\t", ". ", " <|endoftext|> ", "\u00a0", " "]
    return "".join(p + seps[k % len(seps)] for k, p in enumerate(parts))


@pytest.fixture(scope="module")
def text() -> str:
    return real_text()


@pytest.mark.parametrize("tokenizer", [DOLMA2, NEOX])
@pytest.mark.parametrize("backend", ["hf", "fast"])
@pytest.mark.parametrize("split_special_tokens", [True, False])
def test_pieces_give_the_ids_of_the_whole_document(text, tokenizer, backend, split_special_tokens):
    tok = load_tokenizer(tokenizer, backend=backend)
    tok.split_special_tokens = split_special_tokens
    assert why_not_cut(tok) is None
    short = "A short document between the long ones."
    texts = [text, short, text[len(text) // 3 :], short]
    whole, whole_offsets = tok.encode_batch_flat(texts)
    for piece_chars in (8, 300, 20_000):  # 8: a cut at nearly every space that allows one
        assert len(cuts(text, piece_chars)) > len(text) // (piece_chars + 2000)
        ids, offsets = encode_documents(tok, texts, piece_chars)
        assert offsets.tolist() == whole_offsets.tolist(), piece_chars
        assert np.array_equal(ids, whole), piece_chars


def test_cuts_fall_only_before_a_space_after_a_non_space():
    text = "ab  cd\t ef\n gh. ij 12 34 " + "x" * 50 + " y"
    found = cuts(text, 1)
    assert [text[p - 1 : p + 1] for p in found] == ["b ", ". ", "j ", "2 ", "4 ", "x "]  # not "b  c"'s second space, nor "\t "
    assert cuts("x" * 100, 10) == []  # no place to cut: one piece


@pytest.mark.parametrize("change, why", [
    (lambda j: j.update(normalizer={"type": "Strip", "strip_left": True, "strip_right": True}), "normalizer"),
    (lambda j: j["added_tokens"].append({"id": 50300, "content": "a b", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": False}), "added token 'a b'"),
    (lambda j: j["added_tokens"].append({"id": 50300, "content": "<x>", "single_word": False, "lstrip": False, "rstrip": True, "normalized": False, "special": False}), "added token '<x>'"),
    (lambda j: j["model"].update(dropout=0.1), "dropout"),
    (lambda j: j.update(pre_tokenizer={"type": "Whitespace"}), "pre-tokenizer Whitespace"),
])
def test_tokenizers_not_known_to_cut_exactly_are_encoded_whole(tmp_path, change, why):
    spec = json.loads(NEOX.read_text())
    change(spec)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    tok = load_tokenizer(path)
    assert why in why_not_cut(tok)
    texts = ["one two three " * 20]
    assert why == "dropout" or np.array_equal(encode_documents(tok, texts, piece_chars=10)[0], tok.encode_batch_flat(texts)[0])


@pytest.mark.parametrize("unit, workers", [("blocks", 1), ("files", 2)])
def test_prepare_writes_a_document_longer_than_a_piece_as_the_tokenizer_encodes_it_whole(tmp_path, monkeypatch, text, unit, workers):
    big = (text + " ") * (long_docs.PIECE_CHARS // len(text) + 1)
    assert len(big) > long_docs.PIECE_CHARS
    raw = tmp_path / "raw"
    raw.mkdir()
    docs = ["first, short", big, "last, short"]
    (raw / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    (raw / "b.jsonl").write_text(json.dumps({"text": "another file"}) + "\n")
    prepare(PrepareConfig(inputs=[str(raw)], output=tmp_path / "out", tokenizer=str(DOLMA2), progress=False, work_unit=unit, workers=workers,
                          shard_tokens=1 << 20), log=lambda _: None)
    ref = tokenizers.Tokenizer.from_file(str(DOLMA2))
    ref.encode_special_tokens = True  # prepare_data's default: special-token text is text
    eos = ref.token_to_id("<|endoftext|>")
    expected = [i for t in docs + ["another file"] for i in ref.encode(t, add_special_tokens=False).ids + [eos]]
    ids, lens = read_all(tmp_path / "out")
    assert ids.tolist() == expected and len(lens) == 4
    assert shards.Manifest.load(tmp_path / "out").num_docs == 4


def _peak_rss_mb(cmd: list[str]) -> float:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=package_env())
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, err.decode()
    return usage.ru_maxrss / 1024


def test_memory_for_one_long_document_stays_near_that_for_the_same_text_in_short_ones(tmp_path, text):
    """A one-line document once cost the tokenizer's whole working set for it (7.1 GB for 50 MB; the
    backend check encoded it whole too, twice). Now its pieces cost what a block of short documents does."""
    mb = 8
    copies = mb * 1_000_000 // len(text) + 1
    for name, lines in (("short", [text] * copies), ("long", [" ".join([text] * copies)])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    peak = {name: _peak_rss_mb([sys.executable, "-m", "olmo_ds.cli.prepare_data", "--input", str(tmp_path / name), "--output", str(tmp_path / f"out-{name}"),
                                "--tokenizer", str(DOLMA2), "--no-progress"]) for name in ("short", "long")}
    assert shards.Manifest.load(tmp_path / "out-long").num_docs == 1
    assert peak["long"] < peak["short"] + 25 * mb, peak  # the document's text and ids a few times over, not the tokenizer's working set
