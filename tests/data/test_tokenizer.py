import gzip
import json
import re
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


@pytest.mark.parametrize("beside", ["loaded", "beside", "parsed"])
@pytest.mark.parametrize("path", [DOLMA2, NEOX])
def test_fast_backend_matches_hf(path, beside):
    from olmo_ds.fast_parse import FastParse
    from olmo_ds.tokenizer import ADVERSARIAL_TEXTS, fast_beside, first_difference

    parse = FastParse(path) if beside == "parsed" else None  # prepare_data's way: fastokens parses in a thread while HF loads
    hf = load_tokenizer(path)
    fast = {"loaded": lambda: load_tokenizer(path, backend="fast"), "beside": lambda: fast_beside(hf), "parsed": lambda: fast_beside(hf, parse=parse)}[beside]()
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
    from olmo_ds.fast_parse import FastParse
    from olmo_ds.tokenizer import FastBackendError, fast_beside, first_difference

    nfkc = variant(tmp_path, "nfkc", {"type": "NFKC"})
    with pytest.raises(FastBackendError, match="fastokens cannot load it.*NFKC"):
        load_tokenizer(nfkc, backend="fast")
    with pytest.raises(FastBackendError, match=f"{re.escape(str(nfkc))}: fastokens cannot load it.*NFKC"):  # parsed in a thread: the same refusal
        fast_beside(load_tokenizer(nfkc), parse=FastParse(nfkc))
    # fastokens matched HF on every tokenizer feature it loads that we tried, so the report is
    # checked on two tokenizers that really differ: the first differing text, token and ids.
    texts = ["same in both: 1", "Hello world", "naïve"]
    report = first_difference(load_tokenizer(DOLMA2, backend="fast"), load_tokenizer(NEOX), texts, ["a.jsonl:1", "a.jsonl:2", "a.jsonl:3"])
    got, want = (tokenizers.Tokenizer.from_file(str(p)).encode(texts[0], add_special_tokens=False).ids for p in (DOLMA2, NEOX))
    assert report == f"a.jsonl:1: ids differ from token 0 ({got[:4]} vs HF's {want[:4]})"


# What olmo-ds recorded for dolma2's tokenizer.json in every manifest and checkpoint before issue 36 (a hash of
# the whole file's canonical JSON): such shards and checkpoints must keep working.
DOLMA2_LEGACY = "sha256:1b392b8638e97bd38e9447f2fb9c48132bca818f211f25f8c1f21fdbe82d3f3a"


def _resaved(tmp_path) -> dict[str, Path]:
    """dolma2's tokenizer.json written again by transformers (merges as pairs, a post-processor added) and by
    `tokenizers` itself."""
    import transformers

    transformers.PreTrainedTokenizerFast(tokenizer_file=str(DOLMA2)).save_pretrained(tmp_path / "transformers")
    tokenizers.Tokenizer.from_file(str(DOLMA2)).save(str(tmp_path / "tokenizers.json"))
    return {"transformers": tmp_path / "transformers" / "tokenizer.json", "tokenizers": tmp_path / "tokenizers.json"}


def test_fingerprint_survives_resaving_by_transformers_and_tokenizers(tmp_path):
    """Issue 36.2: a tokenizer.json re-saved by transformers was refused as another tokenizer, every id the same."""
    original = load_tokenizer(DOLMA2)
    texts = c4_texts()[:8]
    for who, path in _resaved(tmp_path).items():
        assert path.read_bytes() != DOLMA2.read_bytes(), who
        again = load_tokenizer(path)
        assert again.legacy_fingerprint != original.legacy_fingerprint, who  # the file did change
        assert again.fingerprint == original.fingerprint, who
        assert again.encode_batch(texts) == original.encode_batch(texts), who
        assert again.matches(DOLMA2_LEGACY), f"{who}: shards recorded with the file hash must still be accepted"


def test_legacy_fingerprint_is_what_existing_shards_and_checkpoints_recorded():
    from olmo_ds.tokenizer import LEGACY_CONTENT

    for path in (DOLMA2, NEOX):  # the table of known tokenizers names each one's legacy and content fingerprints
        known = load_tokenizer(path)
        assert LEGACY_CONTENT[known.legacy_fingerprint] == known.fingerprint
    tok = load_tokenizer(DOLMA2)
    assert tok.legacy_fingerprint == DOLMA2_LEGACY and tok.fingerprint != DOLMA2_LEGACY
    assert tok.matches(DOLMA2_LEGACY) and tok.matches(tok.fingerprint)
    assert not tok.matches(load_tokenizer(NEOX).legacy_fingerprint) and not tok.matches(None)


def _edited(tmp_path, name: str, edit) -> Path:
    content = json.loads(DOLMA2.read_text())
    edit(content)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(content))
    return path


def _swap_first_merges(c):
    c["model"]["merges"][0], c["model"]["merges"][1] = c["model"]["merges"][1], c["model"]["merges"][0]


@pytest.mark.parametrize("name, edit", [
    ("one-merge-changed", lambda c: c["model"]["merges"].__setitem__(5, "e n")),
    ("merge-order", _swap_first_merges),
    ("vocab-id", lambda c: c["model"]["vocab"].update({"hello": c["model"]["vocab"]["hello"] + 1,
                                                        "world": c["model"]["vocab"]["hello"]})),
    ("normalizer", lambda c: c.__setitem__("normalizer", {"type": "NFKC"})),
    ("pre-tokenizer", lambda c: c["pre_tokenizer"]["pretokenizers"][0].__setitem__("behavior", "Isolated")),
    ("added-token-flag", lambda c: c["added_tokens"][0].__setitem__("special", not c["added_tokens"][0]["special"])),
    ("model-option", lambda c: c["model"].__setitem__("ignore_merges", True)),
    ("truncation", lambda c: c.__setitem__("truncation", {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0})),
])
def test_a_change_that_changes_ids_changes_the_fingerprint(name, edit, tmp_path):
    changed = load_tokenizer(_edited(tmp_path, name, edit))
    original = load_tokenizer(DOLMA2)
    assert changed.fingerprint != original.fingerprint
    assert not changed.matches(original.fingerprint) and not changed.matches(DOLMA2_LEGACY)


def test_one_changed_merge_changes_ids_and_fingerprint(tmp_path):
    content = json.loads(DOLMA2.read_text())
    i = content["model"]["merges"].index("Ġth e")
    content["model"]["merges"][i] = "Ġt he"  # " the" can no longer be made from " th" + "e" (nor from " t" + "he")
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(content))
    changed, original = load_tokenizer(path), load_tokenizer(DOLMA2)
    assert changed.encode(" the cat") != original.encode(" the cat")
    assert changed.fingerprint != original.fingerprint


def test_post_processor_and_decoder_change_no_id_of_encode_so_not_the_fingerprint(tmp_path):
    """The decision the fingerprint rests on: olmo-ds encodes without special tokens, so a post-processor that
    adds a BOS (what a transformers re-save may carry) changes no id olmo-ds produces; checked on both encoders."""
    def with_bos(c):
        c["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                                                         {"Sequence": {"id": "A", "type_id": 0}}],
                               "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                               "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [100257], "tokens": ["<|endoftext|>"]}}}
        c["decoder"] = None
    path = _edited(tmp_path, "bos", with_bos)
    texts = c4_texts()[:8]
    original, edited = load_tokenizer(DOLMA2), load_tokenizer(path)
    assert tokenizers.Tokenizer.from_file(str(path)).encode("hi").ids[0] == 100257  # the processor is live when asked
    assert edited.encode_batch(texts) == original.encode_batch(texts)
    assert load_tokenizer(path, backend="fast").encode_batch(texts) == original.encode_batch(texts)
    assert edited.fingerprint == original.fingerprint


def test_shards_recorded_with_the_legacy_fingerprint_validate_against_a_resaved_tokenizer(tmp_path):
    """Existing shards keep working: a manifest written before issue 36 (dolma2's file hash) passes validation with
    dolma2 as transformers re-saved it, and with the original; another tokenizer is still refused."""
    from olmo_ds.data import shards
    from olmo_ds.data.prepare.pipeline import PrepareConfig, prepare
    from olmo_ds.data.validate import format_report, validate_directory
    from olmo_ds.tokenizer import same_tokenizer

    out = tmp_path / "shards"
    prepare(PrepareConfig(inputs=[str(C4[0])], output=out, tokenizer=str(DOLMA2), tokenizer_backend="hf", progress=False),
            log=lambda _: None)
    manifest = json.loads((out / shards.MANIFEST).read_text())
    assert manifest["tokenizer_fingerprint"] == load_tokenizer(DOLMA2).fingerprint  # new shards record the content
    manifest["tokenizer_fingerprint"] = DOLMA2_LEGACY
    (out / shards.MANIFEST).write_text(json.dumps(manifest))

    resaved = load_tokenizer(_resaved(tmp_path)["transformers"])
    for tok in (resaved, load_tokenizer(DOLMA2)):
        report = validate_directory(out, tok)
        assert report.ok, format_report(report)
        assert same_tokenizer(DOLMA2_LEGACY, tok) and same_tokenizer(tok, resaved)
    assert "shards made with another tokenizer" in format_report(validate_directory(out, load_tokenizer(NEOX)))
    # two recorded strings: one tokenizer's legacy and current fingerprints (a known tokenizer) are the same
    assert same_tokenizer(DOLMA2_LEGACY, resaved.fingerprint)
    assert not same_tokenizer(DOLMA2_LEGACY, load_tokenizer(NEOX).fingerprint)


def test_output_recorded_with_the_legacy_fingerprint_reruns_and_mixes(tmp_path):
    """A prepare_data output written before issue 36 (its state and manifest record dolma2's file hash) is found
    complete on a rerun, not refused as another tokenizer's; and it mixes with a source written since."""
    import shutil

    from olmo_ds.data import shards
    from olmo_ds.data.config import SourceConfig
    from olmo_ds.data.loader import _open_sources
    from olmo_ds.data.prepare.output import STATE_FILE
    from olmo_ds.data.prepare.pipeline import PrepareConfig, prepare

    def run(out):
        lines = []
        prepare(PrepareConfig(inputs=[str(C4[0])], output=out, tokenizer=str(DOLMA2), tokenizer_backend="hf", progress=False),
                log=lines.append)
        return lines

    old, new = tmp_path / "old", tmp_path / "new"
    run(old)
    shutil.copytree(old, new)
    for name in (STATE_FILE, shards.MANIFEST):
        record = json.loads((old / name).read_text())
        record["tokenizer_fingerprint"] = DOLMA2_LEGACY
        (old / name).write_text(json.dumps(record))
    assert any("already complete" in line for line in run(old))
    assert len(_open_sources([SourceConfig(str(old), name="old"), SourceConfig(str(new), name="new")])) == 2
    with pytest.raises(ValueError, match="tokenized differently"):
        record = json.loads((new / shards.MANIFEST).read_text())
        record["tokenizer_fingerprint"] = load_tokenizer(NEOX).fingerprint
        (new / shards.MANIFEST).write_text(json.dumps(record))
        _open_sources([SourceConfig(str(old), name="old"), SourceConfig(str(new), name="new")])
