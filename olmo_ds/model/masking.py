"""Document masking inside the model: from the loader's per-instance document lengths to the forms
the attention backends take.

A batch's `doc_lens` is `int32 [B, D]`: row b lists the lengths of the document pieces instance b
is cut into, in order, padded on the right with zeros; each row's non-zero entries sum to seq_len
(the loader's contract, `olmo_ds.data.loader`). The model builds its masks from it here:
- flash-attn varlen: `cu_seqlens(doc_lens)` flattens the batch into one packed sequence of
  documents: (`cu_seqlens` int32 [num_docs + 1], `max_seqlen` int).
- flex_attention / SDPA: `document_ids(doc_lens, seq_len)` numbers each token's document, and
  `document_causal_mask(doc_lens, seq_len)` is the boolean [B, 1, T, T] mask "causal and same document".
- flex_attention's block sparsity: `flex_block_mask(...)` classifies every (query block, key block)
  pair as empty, partial or full straight from block boundaries, window and document ids.
"""

from __future__ import annotations

import torch

# flex_attention's default tile: the block mask is described per 128 x 128 tile of the score matrix.
FLEX_BLOCK = 128


def cu_seqlens(doc_lens: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative document boundaries over the flattened batch, as flash_attn_varlen_func wants them."""
    lens = doc_lens[doc_lens > 0].to(torch.int32)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=doc_lens.device)
    cu[1:] = torch.cumsum(lens, 0)
    return cu, int(lens.max())


def document_ids(doc_lens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """int32 [B, T]: the index, within its row, of the document each token belongs to.

    Vectorised (no host sync) so it can run on the GPU inside the forward pass; rows must sum to T.
    """
    ends = doc_lens.to(torch.int64).cumsum(dim=1)
    positions = torch.arange(seq_len, device=doc_lens.device).expand(doc_lens.shape[0], -1).contiguous()
    return torch.searchsorted(ends, positions, right=True).to(torch.int32)


def document_causal_mask(doc_lens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """bool [B, 1, T, T], True where query q may attend key k: k <= q and both in the same document."""
    doc = document_ids(doc_lens, seq_len)
    same = doc[:, :, None] == doc[:, None, :]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=doc_lens.device).tril()
    return (same & causal)[:, None]


def _tile_range(values: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and tile of `block_size` tokens, the min and max of `values` [B, T] (the ragged last tile
    padded with its own last value): two [B, n] tensors."""
    b, t = values.shape
    n = -(-t // block_size)
    padded = torch.cat([values, values[:, -1:].expand(b, n * block_size - t)], dim=1).view(b, n, block_size)
    return padded.amin(-1), padded.amax(-1)


def flex_block_mask(mask_mod, seq_len: int, device, window: int | None = None, doc_ids: torch.Tensor | None = None,
                    block_size: int = FLEX_BLOCK, branches: torch.Tensor | None = None, positions: torch.Tensor | None = None):
    """flex_attention `BlockMask` for causal attention with an optional window and document ids.

    `mask_mod(b, h, q, kv)` is the token rule (applied inside partial tiles); this computes which
    tiles it needs from the rule's structure instead of evaluating it on all T x T pairs as
    `create_block_mask` does: that costs O(T^2) memory per batch (4 G elements at 64K tokens), this
    O(B x (T / block)^2) and no compile. A tile is full when every pair in it is allowed (k <= q,
    q - k < window, one document), empty when the causal band misses it or its documents do not meet,
    else partial. Documents are contiguous runs, so a tile's documents are the range between its first
    and last token's. A partial tile may in fact hold no allowed pair (band and documents each reach
    it, but not at the same pairs); `mask_mod` masks it all, which is exact, only not skipped.
    `doc_ids` is int [B, T] (`document_ids`); without it the mask is shared by the batch (B = 1).

    With `branches` [B, T] (`attention.AttentionMask`: 0 a document's prefix, k > 0 its k-th branch,
    which sees the prefix and itself only) a tile is full only if its keys are all prefix, or its
    queries and keys are all one branch. With `positions` [B, T] the window is measured in positions:
    from each tile's smallest and largest position, not from its row offsets.
    """
    from torch.nn.attention.flex_attention import BlockMask

    n = -(-seq_len // block_size)
    first = torch.arange(n, device=device) * block_size
    last = torch.clamp(first + block_size, max=seq_len) - 1
    # Over the pairs of query tile i and key tile j, q - k spans [first_i - last_j, last_i - first_j];
    # allowed pairs have 0 <= q - k < limit.
    low, high = first[:, None] - last[None, :], last[:, None] - first[None, :]
    if positions is None or window is None:
        limit = seq_len if window is None else window
        reach, full = ((high >= 0) & (low < limit))[None], ((low >= 0) & (high < limit))[None]
    else:
        # Position distance over the pairs of tiles i and j spans [min_i - max_j, max_i - min_j].
        pos_min, pos_max = _tile_range(positions, block_size)
        reach = (high >= 0)[None] & (pos_min[:, :, None] - pos_max[:, None, :] < window)
        full = (low >= 0)[None] & (pos_max[:, :, None] - pos_min[:, None, :] < window)
    if doc_ids is not None:
        doc_first, doc_last = doc_ids[:, first], doc_ids[:, last]  # [B, n] each
        meet = torch.maximum(doc_first[:, :, None], doc_first[:, None, :]) <= torch.minimum(doc_last[:, :, None], doc_last[:, None, :])
        one_doc = (doc_first[:, :, None] == doc_last[:, :, None]) & (doc_first[:, :, None] == doc_first[:, None, :]) & (
            doc_first[:, None, :] == doc_last[:, None, :])
        reach, full = reach & meet, full & one_doc
    if branches is not None:
        br_min, br_max = _tile_range(branches, block_size)
        single = br_min == br_max
        prefix_keys = (br_max == 0)[:, None, :]
        one_branch = single[:, :, None] & single[:, None, :] & (br_min[:, :, None] == br_min[:, None, :])
        full = full & (prefix_keys | one_branch)
    partial = reach & ~full

    def ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query tile: how many key tiles, and their indices first (ascending), as BlockMask wants."""
        counts = tiles.sum(-1, dtype=torch.int32)
        indices = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts[:, None], indices[:, None]  # one head dimension: the rule is the same for every head

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                    seq_lengths=(seq_len, seq_len))
