"""Best-fit decreasing packing of whole documents into rows (olmo_ds/data/packing.py)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from olmo_ds.data.packing import pack_documents

from testdata import SHARED


def chat_sample_lengths() -> np.ndarray:
    """Token counts of the 270 chat-sample conversations (OLMo 3 template, dolma2 tokenizer)."""
    index = (SHARED / "data" / "olmocore-sft-sample" / "sample_index.jsonl").read_text().splitlines()
    return np.array([json.loads(line)["tokens"] for line in index], dtype=np.int64)


def reference_bfd(lengths, seq_len):
    """Best-fit decreasing the slow, obvious way: scan every row for the fullest one the document fits."""
    order = sorted(range(len(lengths)), key=lambda i: -min(lengths[i], seq_len))
    rows, left = [], []
    for i in order:
        size = min(lengths[i], seq_len)
        fits = [r for r in range(len(rows)) if left[r] >= size]
        if fits:
            r = min(fits, key=lambda r: (left[r], r))
        else:
            r = len(rows)
            rows.append([])
            left.append(seq_len)
        rows[r].append(i)
        left[r] -= size
    return rows


def check_invariants(p, lengths, seq_len):
    placed = np.sort(p.doc_index)
    expect = np.setdiff1d(np.arange(len(lengths)), p.dropped)
    np.testing.assert_array_equal(placed, expect)  # every document once (unless dropped), none twice
    np.testing.assert_array_equal(p.doc_tokens, np.minimum(lengths[p.doc_index], seq_len))
    assert (p.row_tokens() <= seq_len).all() and (p.row_tokens() > 0).all()
    assert p.padding == p.num_rows * seq_len - p.tokens >= 0
    assert p.num_rows >= p.min_rows


@pytest.mark.parametrize("seed", range(6))
def test_equals_the_obvious_best_fit_decreasing(seed):
    rng = np.random.default_rng(seed)
    seq_len = int(rng.choice([16, 64, 100]))
    lengths = rng.integers(1, seq_len + 20, size=int(rng.integers(1, 300)))
    p = pack_documents(lengths, seq_len)
    check_invariants(p, lengths, seq_len)
    assert [p.row(r).tolist() for r in range(p.num_rows)] == reference_bfd(lengths.tolist(), seq_len)


def test_chat_sample_packs_close_to_the_lower_bound():
    lengths = chat_sample_lengths()
    for seq_len in (2048, 4096, 8192):
        p = pack_documents(lengths, seq_len)
        check_invariants(p, lengths, seq_len)
        print(f"\nchat-sample, seq_len {seq_len}: {p.summary()}")
        assert p.num_rows <= p.min_rows + 1, p.summary()
    # a realistic large set: the sample's lengths drawn 100K times
    big = np.random.default_rng(0).choice(lengths, size=100_000)
    p = pack_documents(big, 4096)
    check_invariants(p, big, 4096)
    assert p.num_rows <= p.min_rows * 1.001 + 1 and p.efficiency > 0.99, p.summary()


def test_long_documents_truncate_or_drop_and_are_counted():
    lengths = np.array([5, 30, 10, 12, 10, 25])
    t = pack_documents(lengths, 10)
    assert t.truncated.tolist() == [1, 3, 5] and t.tokens_truncated == 20 + 2 + 15 and len(t.dropped) == 0
    assert t.tokens == 5 + 10 + 10 + 10 + 10 + 10 and t.num_rows == 6
    d = pack_documents(lengths, 10, long_docs="drop")
    assert d.dropped.tolist() == [1, 3, 5] and len(d.truncated) == 0 and d.tokens_truncated == 0
    assert sorted(d.doc_index.tolist()) == [0, 2, 4]
    check_invariants(d, lengths, 10)
    with pytest.raises(ValueError, match="long_docs 'split'"):
        pack_documents(lengths, 10, long_docs="split")
    with pytest.raises(ValueError, match="document 2 has 0 tokens"):
        pack_documents([3, 4, 0], 10)


def test_deterministic_and_ties_keep_input_order():
    lengths = np.random.default_rng(1).integers(1, 300, size=5000)
    a, b = pack_documents(lengths, 512), pack_documents(lengths.copy(), 512)
    for name in ("doc_index", "doc_tokens", "row_offsets"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    # equal lengths: the earlier document is placed first, into the earlier row
    p = pack_documents([4, 4, 4, 4], 6)
    assert [p.row(r).tolist() for r in range(p.num_rows)] == [[0], [1], [2], [3]]
    p = pack_documents([3, 3, 3, 3, 2], 6)
    assert [p.row(r).tolist() for r in range(p.num_rows)] == [[0, 1], [2, 3], [4]]


def test_a_million_documents_in_seconds():
    lengths = np.random.default_rng(0).choice(chat_sample_lengths(), size=1_000_000)
    start = time.perf_counter()
    p = pack_documents(lengths, 4096)
    elapsed = time.perf_counter() - start
    print(f"\npacked 1M documents into {p.num_rows:,} rows of 4096 in {elapsed:.2f} s (efficiency {p.efficiency:.4f}, "
          f"lower bound {p.min_rows:,} rows)")
    assert len(p.doc_index) == 1_000_000 and p.num_rows <= p.min_rows * 1.001 + 1
    assert elapsed < 30
