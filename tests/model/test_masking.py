"""Document masking: the forms of doc_lens the attention backends take keep attention inside documents."""

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
