"""Document masking inside the model: from the loader's per-instance document lengths to the forms
the attention backends take.

A batch's `doc_lens` is `int32 [B, D]`: row b lists the lengths of the document pieces instance b
is cut into, in order, padded on the right with zeros; each row's non-zero entries sum to seq_len
(the loader's contract, `olmo_ds.data.loader`). The model builds its masks from it here:
- flash-attn varlen: `cu_seqlens(doc_lens)` flattens the batch into one packed sequence of
  documents: (`cu_seqlens` int32 [num_docs + 1], `max_seqlen` int).
- flex_attention / SDPA: `document_ids(doc_lens, seq_len)` numbers each token's document, and
  `document_causal_mask(doc_lens, seq_len)` is the boolean [B, 1, T, T] mask "causal and same document".
"""

from __future__ import annotations

import torch


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
