"""Perplexity and bits-per-byte: the byte table, agreement with a direct computation, sources, errors."""

import gzip
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from olmo_ds.eval.perplexity import evaluate_perplexity, load_source, token_byte_lengths, window_batches

from eval_testlib import C4, write_shards

torch.set_num_threads(1)


def c4_texts():
    return [json.loads(line)["text"] for path in C4 for line in gzip.open(path, "rt")]


@pytest.mark.parametrize("which", ["neox", "dolma2"])
def test_token_bytes_sum_to_the_decoded_text(which, request):
    tok = request.getfixturevalue(which)
    table = token_byte_lengths(tok)
    texts = c4_texts() + ["emoji 🤖, CJK 中文, accents üé, nbsp\u00a0, tab\t, newline\n!"]
    for text in texts:
        ids = tok.encode(text)
        assert table[ids].sum() == len(tok.decode(ids).encode("utf-8"))
    assert table[tok.eos_id] == 0 and (tok.pad_id is None or table[tok.pad_id] == 0)


@torch.no_grad()
def direct(model, tokens, seq_len, table):
    """One window at a time: F.cross_entropy over every target, bytes by decoding."""
    nats = count = text_nats = nbytes = 0.0
    for s in range(0, len(tokens), seq_len):
        piece = torch.as_tensor(tokens[s : s + seq_len])
        if len(piece) < 2:
            continue
        per_token = F.cross_entropy(model(piece[None, :-1])[0].float(), piece[1:], reduction="none").double()
        nats += float(per_token.sum())
        count += len(piece) - 1
        text = torch.as_tensor(table[piece[1:].numpy()] > 0)
        text_nats += float(per_token[text].sum())
        nbytes += int(table[piece[1:].numpy()].sum())
    return nats / count, text_nats / math.log(2) / nbytes, int(count)


def _jsonl(tmp_path, texts, name="c4.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_perplexity_and_bpb_equal_a_direct_computation(model, neox, tmp_path):
    source = load_source(f"web={_jsonl(tmp_path, c4_texts()[:4])}", neox)
    assert (source.name, source.kind, source.documents) == ("web", "jsonl", 4)
    expected_tokens = sum(len(neox.encode(t)) + 1 for t in c4_texts()[:4])
    assert len(source.tokens) == expected_tokens and (source.tokens == neox.eos_id).sum() >= 4

    table = token_byte_lengths(neox)
    result = evaluate_perplexity(model, window_batches(source.tokens, 64, 4), table)
    ce, bpb, count = direct(model, source.tokens, 64, table)
    assert result.tokens == count
    assert result.ce_loss == pytest.approx(ce, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(ce), rel=1e-5)
    assert result.bits_per_byte == pytest.approx(bpb, rel=1e-5)
    # bytes: every text target once (the first token of each window is never a target)
    assert result.text_tokens < result.tokens and result.bytes == int(sum(table[source.tokens[s + 1 : s + 64]].sum() for s in range(0, len(source.tokens), 64)))


def test_shard_source_equals_jsonl_source(model, neox, tmp_path):
    from_text = load_source(str(_jsonl(tmp_path, c4_texts()[:3])), neox)
    write_shards(tmp_path / "corpus" / "val", from_text.tokens, neox, 3)
    from_shards = load_source(str(tmp_path / "corpus"), neox)  # the directory's val/ split
    assert (from_shards.name, from_shards.kind, from_shards.documents) == ("corpus", "shards", 3)
    np.testing.assert_array_equal(from_shards.tokens, from_text.tokens)
    table = token_byte_lengths(neox)
    a = evaluate_perplexity(model, window_batches(from_text.tokens, 48, 3), table)
    b = evaluate_perplexity(model, window_batches(from_shards.tokens, 48, 3), table)
    assert (a.ce_loss, a.bits_per_byte, a.tokens) == (b.ce_loss, b.bits_per_byte, b.tokens)
    assert len(load_source(str(tmp_path / "corpus"), neox, max_tokens=100).tokens) == 100


def test_shards_of_another_tokenizer_are_refused(neox, dolma2, tmp_path):
    tokens = np.array(dolma2.encode(c4_texts()[0]) + [dolma2.eos_id])
    write_shards(tmp_path / "val", tokens, dolma2, 1)
    with pytest.raises(ValueError, match=r"manifest.json: shards were written with tokenizer sha256:\w+, but the model's tokenizer .*gpt-neox"):
        load_source(str(tmp_path / "val"), neox)


def test_bad_text_sources(neox, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: 'text' must be a string"):
        load_source(str(bad), neox)
    bad.write_text('{"text": "fine"}\n\n{"text": "x"\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: malformed JSON"):
        load_source(str(bad), neox)
    bad.write_text('{"body": "fine"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: missing key 'text'"):
        load_source(str(bad), neox)
    assert load_source(str(bad), neox, text_field="body").documents == 1
    with pytest.raises(FileNotFoundError, match="no such evaluation data"):
        load_source(str(tmp_path / "missing"), neox)
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="not a shard directory"):
        load_source(str(tmp_path / "notes.csv"), neox)
