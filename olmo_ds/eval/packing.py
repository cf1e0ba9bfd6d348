"""Log-likelihood requests packed into rows of one fixed width: one forward per batch, one batch shape.

A request is (context, continuation); its score reads the model's distribution at the context's last
position (for the first continuation token) and at each continuation token but the last. The choices
of a question share their context, so a row holds a *group*: the context once, then each distinct
continuation's tokens but its last as a branch that sees the context and itself, not its siblings
(`olmo_ds.model.attention.AttentionMask`, `branches`). A branch's RoPE positions continue from the
end of its context, so every scored position sees exactly the tokens, at exactly the positions, it
would see in a row of its own: the scores are those of one request at a time, up to float rounding.

    row:       | context A ......| A's choice 1 | A's choice 2 | context B ...| B's choice 1 | pad |
    positions:   0 1 2 ... a-1     a a+1 ...      a a+1 ...      0 1 ... b-1   b ...          0 0
    branches:    0 0 0 ... 0       1 1 ...        2 2 ...        0 0 ... 0     1 ...          0 0
    documents:   one per group, and the padding at the end of the row its own

Groups are packed into rows best-fit, largest first; a group longer than a row is split into several,
each with its own copy of the context. Rows are `row_len` wide, a power of two at least the longest
(context + one continuation) and by default at least `PACK_ROW` (fewer, fuller rows; the flex kernel
skips the tiles that no group reaches, so a wider row costs no attention). Batches hold equally many
rows (the last one topped up with rows of padding), at most `batch_tokens // row_len`: every forward
has the one shape [rows_per_batch, row_len], so compiled blocks serve it after one compile.

The plan depends only on the requests and the sizes, never on the rank, so every rank of a
distributed evaluation builds the same batches and takes its share (`scoring.run_split`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

# Default smallest row: wide enough that a row holds many short groups (multiple-choice questions run
# 50-500 tokens), narrow enough that a dense mask (SDPA, CPU) of a batch stays small.
PACK_ROW = 1024


@dataclass
class PackedBatch:
    """One forward: `model(input_ids, doc_lens=, positions=, branches=, score=(index, targets))`."""

    input_ids: torch.Tensor  # int64 [B, W]
    positions: torch.Tensor  # int64 [B, W]: RoPE positions
    branches: torch.Tensor  # int32 [B, W]: 0 a context (or padding), k > 0 its k-th continuation
    doc_lens: torch.Tensor  # int32 [B, D]: each row's group lengths, then its padding, zero-padded
    index: torch.Tensor  # int64 [N]: flat position b * W + t of each scored target
    targets: torch.Tensor  # int64 [N]
    items: np.ndarray  # int64 [K]: the item each run of targets belongs to, in target order
    starts: np.ndarray  # int64 [K]: where each item's run of targets starts (its length is its continuation's)


@dataclass
class PackPlan:
    batches: list[PackedBatch]
    row_len: int
    rows_per_batch: int
    rows: int  # rows holding groups (the rest of the batches' rows are padding)
    tokens: int  # tokens of the groups: what must run
    padded_tokens: int  # every position of every batch: what does run


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def row_width(longest: int, batch_tokens: int, min_row: int | None = None) -> int:
    """Row width for groups whose longest (context + one continuation - 1) is `longest` tokens."""
    floor = min(PACK_ROW, max(1, batch_tokens // 4)) if min_row is None else min_row
    return _next_pow2(max(longest, floor))


def plan_packed(items: list[tuple[tuple[int, ...], tuple[int, ...]]], batch_tokens: int, pad_id: int = 0,
                min_row: int | None = None) -> PackPlan:
    """The batches that score every (context, continuation) of `items` (distinct, contexts non-empty).

    `batch_tokens`: positions per forward (rows x row width), at least one row. `min_row`: the
    smallest row width (default: `PACK_ROW`, or a quarter of `batch_tokens` if that is less).
    """
    if not items:
        return PackPlan([], 0, 0, 0, 0, 0)
    by_context: dict[tuple[int, ...], list[int]] = {}
    for item, (ctx, cont) in enumerate(items):
        if not ctx or not cont:
            raise ValueError(f"item {item}: packing needs a non-empty context and continuation")
        by_context.setdefault(ctx, []).append(item)
    row_len = row_width(max(len(c) + len(k) - 1 for c, k in items), batch_tokens, min_row)

    # Groups no longer than a row: a context with as many of its continuations as fit.
    groups: list[tuple[int, tuple[int, ...], list[int]]] = []  # (tokens, context, items)
    for ctx, members in by_context.items():
        size, taken = len(ctx), []
        for item in members:
            extra = len(items[item][1]) - 1
            if taken and size + extra > row_len:
                groups.append((size, ctx, taken))
                size, taken = len(ctx), []
            size += extra
            taken.append(item)
        groups.append((size, ctx, taken))

    # Best fit, largest first: each group into the fullest row it fits.
    rows: list[list[int]] = []  # group indices per row
    free: list[tuple[int, int]] = []  # (free tokens, row), sorted
    for g in sorted(range(len(groups)), key=lambda g: (-groups[g][0], g)):
        size = groups[g][0]
        at = bisect.bisect_left(free, (size, -1))
        if at == len(free):
            rows.append([g])
            bisect.insort(free, (row_len - size, len(rows) - 1))
        else:
            left, r = free.pop(at)
            rows[r].append(g)
            bisect.insort(free, (left - size, r))

    per_batch_max = max(1, batch_tokens // row_len)
    num_batches = -(-len(rows) // per_batch_max)
    per_batch = -(-len(rows) // num_batches)  # as even as can be: the last batch is nearly full too
    batches = [_build_batch(rows[b * per_batch:(b + 1) * per_batch], per_batch, row_len, groups, items, pad_id)
               for b in range(num_batches)]
    tokens = sum(size for size, _, _ in groups)
    return PackPlan(batches, row_len, per_batch, len(rows), tokens, num_batches * per_batch * row_len)


def _build_batch(rows: list[list[int]], num_rows: int, row_len: int, groups, items, pad_id: int) -> PackedBatch:
    ids = np.full((num_rows, row_len), pad_id, dtype=np.int64)
    positions = np.zeros((num_rows, row_len), dtype=np.int64)
    branches = np.zeros((num_rows, row_len), dtype=np.int32)
    doc_lens: list[list[int]] = []
    index: list[int] = []
    targets: list[int] = []
    order: list[int] = []
    starts: list[int] = []
    for r in range(num_rows):
        at, lens = 0, []
        for g in rows[r] if r < len(rows) else []:
            size, ctx, members = groups[g]
            n = len(ctx)
            ids[r, at:at + n] = ctx
            positions[r, at:at + n] = np.arange(n)
            last_ctx = r * row_len + at + n - 1
            branch_at, branch = at + n, 0
            for item in members:
                cont = items[item][1]
                order.append(item)
                starts.append(len(targets))
                index.append(last_ctx)
                targets.append(cont[0])
                if len(cont) > 1:
                    branch += 1
                    m = len(cont) - 1
                    ids[r, branch_at:branch_at + m] = cont[:-1]
                    positions[r, branch_at:branch_at + m] = np.arange(n, n + m)
                    branches[r, branch_at:branch_at + m] = branch
                    index.extend(range(r * row_len + branch_at, r * row_len + branch_at + m))
                    targets.extend(cont[1:])
                    branch_at += m
            lens.append(size)
            at += size
        if at < row_len:
            lens.append(row_len - at)
        doc_lens.append(lens)
    width = max(len(lens) for lens in doc_lens)
    doc_lens_arr = np.zeros((num_rows, width), dtype=np.int32)
    for r, lens in enumerate(doc_lens):
        doc_lens_arr[r, :len(lens)] = lens
    return PackedBatch(
        input_ids=torch.from_numpy(ids), positions=torch.from_numpy(positions), branches=torch.from_numpy(branches),
        doc_lens=torch.from_numpy(doc_lens_arr), index=torch.tensor(index, dtype=torch.int64),
        targets=torch.tensor(targets, dtype=torch.int64), items=np.array(order, dtype=np.int64),
        starts=np.array(starts, dtype=np.int64),
    )
