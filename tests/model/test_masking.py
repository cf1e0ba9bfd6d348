"""Document masking: the forms of doc_lens the attention backends take keep attention inside documents."""

import pytest
import torch
import torch.nn.functional as F

from olmo_ds.model import masking


def test_document_causal_attention_equals_attending_each_document_alone():
    torch.manual_seed(0)
    T, H, D = 12, 2, 8
    doc_lens = torch.tensor([[5, 4, 3, 0], [12, 0, 0, 0], [1, 2, 3, 6]], dtype=torch.int32)
    q, k, v = (torch.randn(3, H, T, D) for _ in range(3))
    masked = F.scaled_dot_product_attention(q, k, v, attn_mask=masking.document_causal_mask(doc_lens, T))
    for b, lens in enumerate(doc_lens):
        start = 0
        for n in lens[lens > 0].tolist():
            s = slice(start, start + n)
            alone = F.scaled_dot_product_attention(q[b : b + 1, :, s], k[b : b + 1, :, s], v[b : b + 1, :, s], is_causal=True)
            torch.testing.assert_close(masked[b : b + 1, :, s], alone)
            start += n


def test_cu_seqlens_pack_the_rows_documents():
    doc_lens = torch.tensor([[5, 4, 3, 0], [12, 0, 0, 0]], dtype=torch.int32)
    cu, max_len = masking.cu_seqlens(doc_lens)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 9, 12, 24] and max_len == 12
    assert masking.document_ids(doc_lens, 12)[0].tolist() == [0] * 5 + [1] * 4 + [2] * 3


def tile_sets(num: torch.Tensor, indices: torch.Tensor) -> set[tuple[int, int, int]]:
    """(batch, query tile, key tile) of one BlockMask index pair (kv_num_blocks / kv_indices form)."""
    return {(b, i, int(indices[b, 0, i, n])) for b in range(num.shape[0]) for i in range(num.shape[2])
            for n in range(int(num[b, 0, i]))}


@pytest.mark.parametrize("window", [None, 5, 12, 40])
@pytest.mark.parametrize("doc_lens", [None, [[5, 4, 3, 16, 9], [37, 0, 0, 0, 0]], [[1, 2, 30, 4, 0], [8, 8, 8, 8, 5]]])
def test_flex_block_mask_tiles_cover_every_allowed_pair_and_full_tiles_are_all_allowed(window, doc_lens):
    """Tile classes from block boundaries against the token rule itself, with 8-token tiles over 37 tokens
    (a ragged last tile): every allowed pair lies in a listed tile, and a tile listed full (its rule
    skipped by the kernel) holds allowed pairs only."""
    T, S = 37, 8
    doc = None if doc_lens is None else masking.document_ids(torch.tensor(doc_lens), T)
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = ((k <= q) & ((q - k < window) if window else True))[None].expand(2, T, T)
    if doc is not None:
        allowed = allowed & (doc[:, :, None] == doc[:, None, :])
    bm = masking.flex_block_mask(lambda b, h, qi, ki: None, T, "cpu", window, doc, block_size=S)
    partial = tile_sets(bm.kv_num_blocks, bm.kv_indices)
    full = tile_sets(bm.full_kv_num_blocks, bm.full_kv_indices)
    assert not partial & full
    for b in range(2):
        for i in range(-(-T // S)):
            for j in range(-(-T // S)):
                tile = allowed[min(b, allowed.shape[0] - 1), i * S:(i + 1) * S, j * S:(j + 1) * S]
                b_key = b if doc is not None else 0
                if (b_key, i, j) in full:
                    assert tile.all(), (b, i, j)
                elif tile.any():
                    assert (b_key, i, j) in partial, (b, i, j)
    if doc is None:  # no documents: one mask for the batch, and the tiles are exact (none listed in vain)
        assert bm.kv_num_blocks.shape[0] == 1
        assert all(allowed[0, i * S:(i + 1) * S, j * S:(j + 1) * S].any() for _, i, j in partial)
    else:  # tiles whose documents never meet are skipped (the point of block sparsity for packed documents)
        same_doc = doc[:, :, None] == doc[:, None, :]
        assert all(same_doc[b, i * S:(i + 1) * S, j * S:(j + 1) * S].any() for b, i, j in partial)


@pytest.mark.parametrize("window", [None, 3, 9])
def test_flex_block_mask_with_branches_and_positions(window):
    """Branches (a document's prefix 0, its continuations 1, 2, ... each seeing the prefix and itself) and
    windows in RoPE positions: the same two properties against the token rule, on 4-token tiles."""
    T, S = 30, 4
    doc_lens = torch.tensor([[10, 14, 6], [30, 0, 0]])
    branches = torch.tensor([[0] * 4 + [1] * 3 + [2] * 3 + [0] * 5 + [1] * 8 + [2] + [0] * 6,
                             [0] * 9 + [1] * 5 + [2] * 9 + [3] * 7])
    positions = torch.tensor([list(range(7)) + list(range(4, 7)) + list(range(13)) + [5] + list(range(6)),
                              list(range(14)) + list(range(9, 18)) + list(range(9, 16))])
    doc = masking.document_ids(doc_lens, T)
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (k <= q)[None] & (doc[:, :, None] == doc[:, None, :])
    allowed = allowed & ((branches[:, None, :] == 0) | (branches[:, None, :] == branches[:, :, None]))
    if window:
        allowed = allowed & (positions[:, :, None] - positions[:, None, :] < window)
    bm = masking.flex_block_mask(lambda b, h, qi, ki: None, T, "cpu", window, doc, block_size=S, branches=branches,
                                 positions=positions)
    partial = tile_sets(bm.kv_num_blocks, bm.kv_indices)
    full = tile_sets(bm.full_kv_num_blocks, bm.full_kv_indices)
    assert not partial & full and (full or window == 3)  # a 4-token tile spans at least 3 positions
    for b in range(2):
        for i in range(-(-T // S)):
            for j in range(-(-T // S)):
                tile = allowed[b, i * S:(i + 1) * S, j * S:(j + 1) * S]
                if (b, i, j) in full:
                    assert tile.all(), (b, i, j)
                elif tile.any():
                    assert (b, i, j) in partial, (b, i, j)
