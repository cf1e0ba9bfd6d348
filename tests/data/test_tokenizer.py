import gzip
import json
from pathlib import Path

import pytest
import tokenizers

from olmo_ds.tokenizer import load_tokenizer
from testdata import SHARED

DOLMA2 = SHARED / "tokenizers" / "dolma2-tokenizer.json"
NEOX = SHARED / "tokenizers" / "gpt-neox-olmo-dolma-v1_5.json"
C4 = sorted((SHARED / "data" / "c4-sample").glob("*.json.gz"))


def c4_texts() -> list[str]:
    texts = []
    for path in C4:
        with gzip.open(path, "rt") as f:
            texts += [json.loads(line)["text"] for line in f]
    return texts


@pytest.mark.parametrize(
    "path, vocab_size, eos_id, pad_id",
    [(DOLMA2, 100278, 100257, 100277), (NEOX, 50280, 50279, 1)],
)
def test_real_tokenizers(path, vocab_size, eos_id, pad_id):
    tok = load_tokenizer(path)
    assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (vocab_size, eos_id, pad_id)
    reference = tokenizers.Tokenizer.from_file(str(path))
    texts = c4_texts()
    assert len(texts) == 30
    expected = [reference.encode(t, add_special_tokens=False).ids for t in texts]
    assert [tok.encode(t) for t in texts] == expected
    assert tok.encode_batch(texts) == expected
    assert all(max(ids) < tok.vocab_size for ids in expected)
    assert tok.decode(expected[0]) == texts[0]


def test_fingerprint_is_of_content_not_formatting(tmp_path):
    reformatted = tmp_path / "tokenizer.json"
    reformatted.write_text(json.dumps(json.loads(NEOX.read_text()), indent=4))
    a, b = load_tokenizer(NEOX), load_tokenizer(tmp_path)  # a directory holding tokenizer.json
    assert a.fingerprint == b.fingerprint and a.fingerprint.startswith("sha256:")
    assert load_tokenizer(DOLMA2).fingerprint != a.fingerprint


def test_eos_override_and_refusal(tmp_path):
    assert load_tokenizer(DOLMA2, eos_token="<|im_end|>").eos_id == 100265
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        load_tokenizer(DOLMA2, eos_token="<|no such token|>")
    d = json.loads(NEOX.read_text())
    d["added_tokens"] = [t for t in d["added_tokens"] if t["content"] != "<|endoftext|>"]
    del d["model"]["vocab"]["<|endoftext|>"]
    no_eos = tmp_path / "no_eos.json"
    no_eos.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="no recognizable EOS.*--eos-token"):
        load_tokenizer(no_eos)
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        load_tokenizer(tmp_path / "missing.json")


def test_tokenizer_config_names_eos(tmp_path):
    (tmp_path / "tokenizer.json").write_text(DOLMA2.read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}, "pad_token": "<|endoftext|>"}))
    tok = load_tokenizer(tmp_path)
    assert (tok.eos_id, tok.pad_id) == (100265, 100257)


def test_sentencepiece(tmp_path):
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(c4_texts()))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=300, model_type="bpe",
        pad_id=3, minloglevel=2, num_threads=1,
    )
    tok = load_tokenizer(tmp_path / "sp.model")
    reference = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (300, reference.eos_id(), 3)
    texts = c4_texts()[:5]
    assert tok.encode_batch(texts) == [reference.encode(t) for t in texts]
    assert tok.fingerprint.startswith("sha256:")


def code_and_prose() -> list[str]:
    """Real code and prose: standard library modules and their docstrings."""
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name in ("json/decoder.py", "textwrap.py", "argparse.py", "difflib.py", "fractions.py", "email/utils.py"):
        source = (root / name).read_text()
        texts.append(source)
        texts += [d for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and (d := ast.get_docstring(n))]
    return texts


@pytest.mark.parametrize("beside", [False, True])
@pytest.mark.parametrize("path", [DOLMA2, NEOX])
def test_fast_backend_matches_hf(path, beside):
    from olmo_ds.tokenizer import ADVERSARIAL_TEXTS, fast_beside, first_difference

    hf = load_tokenizer(path)
    fast = fast_beside(hf) if beside else load_tokenizer(path, backend="fast")  # prepare_data's way, and the plain one
    assert (hf.backend, fast.backend) == ("tokenizers", "fastokens")
    assert (fast.vocab_size, fast.eos_id, fast.pad_id, fast.fingerprint) == (hf.vocab_size, hf.eos_id, hf.pad_id, hf.fingerprint)
    reference = tokenizers.Tokenizer.from_file(str(path))
    for texts in (c4_texts(), code_and_prose(), ADVERSARIAL_TEXTS):
        expected = [reference.encode(t, add_special_tokens=False).ids for t in texts]
        assert fast.encode_batch(texts) == expected
        flat, offsets = fast.encode_batch_flat(texts)
        assert flat.tolist() == [i for ids in expected for i in ids] and offsets[-1] == len(flat)
        assert first_difference(fast, hf, texts, [str(i) for i in range(len(texts))]) is None
    assert fast.encode(ADVERSARIAL_TEXTS[1]) == hf.encode(ADVERSARIAL_TEXTS[1]) == reference.encode("a<|endoftext|>b", add_special_tokens=False).ids


def variant(tmp_path, name: str, normalizer: dict) -> Path:
    """The OLMo 1 tokenizer with another normalizer: a feature fastokens lacks, or one it gets wrong."""
    d = json.loads(NEOX.read_text())
    d["normalizer"] = normalizer
    out = tmp_path / name / "tokenizer.json"
    out.parent.mkdir()
    out.write_text(json.dumps(d))
    return out


def test_fast_backend_refusal_and_difference_are_reported(tmp_path):
    from olmo_ds.tokenizer import FastBackendError, first_difference

    with pytest.raises(FastBackendError, match="fastokens cannot load it.*NFKC"):
        load_tokenizer(variant(tmp_path, "nfkc", {"type": "NFKC"}), backend="fast")
    # fastokens matched HF on every tokenizer feature it loads that we tried, so the report is
    # checked on two tokenizers that really differ: the first differing text, token and ids.
    texts = ["same in both: 1", "Hello world", "naïve"]
    report = first_difference(load_tokenizer(DOLMA2, backend="fast"), load_tokenizer(NEOX), texts, ["a.jsonl:1", "a.jsonl:2", "a.jsonl:3"])
    got, want = (tokenizers.Tokenizer.from_file(str(p)).encode(texts[0], add_special_tokens=False).ids for p in (DOLMA2, NEOX))
    assert report == f"a.jsonl:1: ids differ from token 0 ({got[:4]} vs HF's {want[:4]})"
