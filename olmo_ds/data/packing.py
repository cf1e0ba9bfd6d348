"""Whole documents (conversations) packed into fixed-length rows by best-fit decreasing.

Fine-tuning trains on whole conversations: a conversation cut across two rows loses its context in
the second, and concatenate-and-chunk (pretraining's `dataset.py`) cuts nearly every one. Packing
instead places each document, whole, into a row of `seq_len` tokens and pads the rest; attention is
kept inside each document by the model's document masking (`doc_lens`). The packer is OLMo-core's
choice, Optimized Best-Fit Decreasing ("Fewer Truncations Improve Language Modeling", arXiv
2404.10830; OLMo-core `InstancePacker`, src/olmo_core/data/utils.py l.806-943): documents sorted by
length, longest first, each placed in the fullest row it still fits, a new row opened when none does.

Structure: rows are grouped by remaining capacity (an integer in [0, seq_len)); a sorted list of the
capacities that have rows answers "the smallest capacity >= this length" by bisection, and each
capacity keeps a heap of its rows. Each placement is a bisection, a heap pop and push, and at most one
insertion into and one removal from the list of at most seq_len capacities: O(n log n) overall, all
inner steps in C (about a second per million documents on one core; `tests/data/test_packing.py` prints it).

The result is a pure function of the lengths and `seq_len`: ties in length keep the documents' input
order (stable sort), and of equally full rows the one opened first is chosen. Rows come out in the
order they were opened (longest first document first), so the caller shuffles them; no seed is needed.

Documents longer than `seq_len`: `truncate` keeps their first `seq_len` tokens (a row of their own;
OLMo-core's `LongDocStrategy.truncate`), `drop` leaves them out. Both are counted. An empty document
is an error: there is nothing to place, and a caller that produced one has lost track of its data.

Preference pairs (`pack_pairs`): a pair's chosen and rejected conversations share their prompt and are
compared with each other, so the unit placed is the PAIR, whole: best-fit decreasing on the pair's total
length, both documents adjacent in one row, chosen first. The result is the same `Packing` over documents
(a pair's two documents are two entries, so the read path needs nothing new), with `paired` set. A pair
longer than `seq_len` cannot be cut (its reply is what is compared): `refuse` raises `LongPairError`
naming it, `drop` leaves it out and counts it.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass

import numpy as np

LONG_DOCS = ("truncate", "drop")
LONG_PAIRS = ("refuse", "drop")


class LongPairError(ValueError):
    """A preference pair longer than a row, under `long_pairs="refuse"`; `pair` is its index, `tokens` its length."""

    def __init__(self, pair: int, tokens: int, seq_len: int, count: int):
        super().__init__(f"pair {pair} has {tokens} tokens (chosen + rejected), more than a row of seq_len {seq_len} "
                         f"({count} such pairs in all)")
        self.pair, self.tokens, self.seq_len, self.count = pair, tokens, seq_len, count


@dataclass(frozen=True)
class Packing:
    """Rows of documents. Row r holds documents `doc_index[row_offsets[r]:row_offsets[r + 1]]`, in that
    order, with `doc_tokens` (aligned with `doc_index`) tokens each: the document's length, or
    `seq_len` for a truncated one. The rest of the row is padding."""

    seq_len: int
    doc_index: np.ndarray  # int64, the placed documents' indexes into the input, row by row
    doc_tokens: np.ndarray  # int64, tokens each placed document contributes
    row_offsets: np.ndarray  # int64 [rows + 1] into doc_index
    truncated: np.ndarray  # int64, indexes of documents cut to seq_len (placed)
    dropped: np.ndarray  # int64, indexes of documents left out (long_docs="drop"; for pairs, both documents of each)
    tokens_truncated: int  # tokens cut from truncated documents (not counted in `tokens`)
    paired: bool = False  # documents 2i, 2i + 1 are a preference pair, placed together (`pack_pairs`)

    @property
    def num_rows(self) -> int:
        return len(self.row_offsets) - 1

    @property
    def tokens(self) -> int:
        """Document tokens placed in rows."""
        return int(self.doc_tokens.sum())

    @property
    def padding(self) -> int:
        return self.num_rows * self.seq_len - self.tokens

    @property
    def efficiency(self) -> float:
        """tokens / (rows * seq_len): the share of row positions holding document tokens."""
        return self.tokens / (self.num_rows * self.seq_len) if self.num_rows else 1.0

    @property
    def min_rows(self) -> int:
        """The lower bound no packing can beat: ceil(tokens / seq_len)."""
        return math.ceil(self.tokens / self.seq_len)

    def row(self, r: int) -> np.ndarray:
        return self.doc_index[self.row_offsets[r]:self.row_offsets[r + 1]]

    def row_doc_lengths(self, r: int) -> np.ndarray:
        """Tokens of each document of row r, in row order (the row's `doc_lens` before its padding)."""
        return self.doc_tokens[self.row_offsets[r]:self.row_offsets[r + 1]]

    def row_tokens(self) -> np.ndarray:
        """Document tokens per row, int64 [rows]."""
        return np.add.reduceat(self.doc_tokens, self.row_offsets[:-1]) if self.num_rows else np.zeros(0, np.int64)

    def row_pairs(self, r: int) -> np.ndarray:
        """The pair indexes of row r, in row order (a `paired` packing)."""
        return self.row(r)[0::2] // 2

    def summary(self) -> dict:
        out = {"seq_len": self.seq_len, "documents": len(self.doc_index), "rows": self.num_rows, "min_rows": self.min_rows,
               "tokens": self.tokens, "padding": self.padding, "efficiency": round(self.efficiency, 6),
               "truncated": len(self.truncated), "tokens_truncated": self.tokens_truncated, "dropped": len(self.dropped)}
        if self.paired:
            out.update(pairs=len(self.doc_index) // 2, dropped_pairs=len(self.dropped) // 2)
        return out


def pack_documents(lengths, seq_len: int, long_docs: str = "truncate") -> Packing:
    """Best-fit decreasing packing of documents of `lengths` tokens into rows of `seq_len` (see the module docstring)."""
    if long_docs not in LONG_DOCS:
        raise ValueError(f"long_docs {long_docs!r}: expected one of {', '.join(LONG_DOCS)}")
    if seq_len < 1:
        raise ValueError(f"seq_len {seq_len}: must be at least 1")
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths must be a 1-D integer array, got {lengths.dtype} of shape {lengths.shape}")
    lengths = lengths.astype(np.int64)
    if len(lengths) and lengths.min() < 1:
        i = int(np.argmin(lengths))
        raise ValueError(f"document {i} has {int(lengths[i])} tokens: every document must have at least one")
    long = np.flatnonzero(lengths > seq_len)
    if long_docs == "drop":
        keep = np.flatnonzero(lengths <= seq_len)
        truncated, dropped, cut = np.zeros(0, np.int64), long, 0
    else:
        keep = np.arange(len(lengths), dtype=np.int64)
        truncated, dropped, cut = long, np.zeros(0, np.int64), int((lengths[long] - seq_len).sum())
    placed = np.minimum(lengths[keep], seq_len)
    order = np.argsort(-placed, kind="stable")  # longest first; equal lengths in input order
    docs, sizes = keep[order].tolist(), placed[order].tolist()

    caps: list[int] = []  # sorted capacities (remaining tokens) that have at least one open row
    rows_at: dict[int, list[int]] = {}  # capacity -> heap of row numbers with that capacity
    row_of = [0] * len(docs)  # row number of each placed document, in placement order
    rows = 0
    for j, size in enumerate(sizes):
        k = bisect.bisect_left(caps, size)
        if k == len(caps):  # fits no open row: open one
            row, left = rows, seq_len - size
            rows += 1
        else:
            cap = caps[k]
            heap = rows_at[cap]
            row = heapq.heappop(heap)
            if not heap:
                del rows_at[cap]
                del caps[k]
            left = cap - size
        row_of[j] = row
        if left:  # a full row takes no more documents
            heap = rows_at.get(left)
            if heap is None:
                rows_at[left] = [row]
                bisect.insort(caps, left)
            else:
                heapq.heappush(heap, row)

    by_row = np.argsort(np.asarray(row_of, dtype=np.int64), kind="stable")  # placement order within a row
    counts = np.bincount(np.asarray(row_of, dtype=np.int64), minlength=rows)
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return Packing(seq_len, np.asarray(docs, dtype=np.int64)[by_row], np.asarray(sizes, dtype=np.int64)[by_row], offsets,
                   truncated, dropped, cut)


def pack_pairs(chosen, rejected, seq_len: int, long_pairs: str = "refuse") -> Packing:
    """Preference pairs, each whole, into rows of `seq_len` by best-fit decreasing on the pair's total length
    (the module docstring): pair i's documents are 2i (`chosen[i]` tokens) and 2i + 1 (`rejected[i]`)."""
    if long_pairs not in LONG_PAIRS:
        raise ValueError(f"long_pairs {long_pairs!r}: expected one of {', '.join(LONG_PAIRS)}")
    chosen, rejected = np.asarray(chosen, dtype=np.int64), np.asarray(rejected, dtype=np.int64)
    if chosen.shape != rejected.shape or chosen.ndim != 1:
        raise ValueError(f"pairs need one chosen and one rejected length each, got {chosen.shape} and {rejected.shape}")
    if len(chosen) and min(chosen.min(), rejected.min()) < 1:
        i = int(np.argmin(np.minimum(chosen, rejected)))
        raise ValueError(f"pair {i} has a side of {int(min(chosen[i], rejected[i]))} tokens: every document must have at least one")
    totals = chosen + rejected
    long = np.flatnonzero(totals > seq_len)
    if len(long) and long_pairs == "refuse":
        raise LongPairError(int(long[0]), int(totals[long[0]]), seq_len, len(long))
    rows = pack_documents(totals, seq_len, long_docs="drop")
    pairs = rows.doc_index
    doc_index = np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)
    doc_tokens = np.stack([chosen[pairs], rejected[pairs]], axis=1).reshape(-1)
    dropped = np.stack([2 * rows.dropped, 2 * rows.dropped + 1], axis=1).reshape(-1)
    return Packing(seq_len, doc_index, doc_tokens, 2 * rows.row_offsets, np.zeros(0, np.int64), dropped, 0, paired=True)
