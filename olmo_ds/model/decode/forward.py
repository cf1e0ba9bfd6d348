"""One forward of generation: the model's own blocks over a `SlotCache`, the head on chosen positions only.

The embedding, the blocks (their eager path: a cache makes them hand attention to it), the final norm and
the head are the model's modules, so generation runs the arithmetic training and scoring run. RoPE tables
come from each token's own position. Only the positions whose next token is wanted (a prompt's last, every
decoding row) go through the head: a prefill of thousands of tokens computes a few rows of logits. On a GPU a
decode step runs the same arithmetic through `compiled.CompiledStep` (the element-wise work fused).
"""

from __future__ import annotations

import torch

from olmo_ds.model.decode.cache import SlotCache
from olmo_ds.model.decode.compiled import CompiledStep
from olmo_ds.model.model import OLMo


def forward_logits(model: OLMo, ids: torch.Tensor, positions: torch.Tensor, cache: SlotCache, last: torch.Tensor,
                   step: CompiledStep | None = None) -> torch.Tensor:
    """Logits [len(last), padded_vocab] at the flat positions `last` of `ids` [B, T] (positions: [B, T]). `step`: a
    decode step ([B, 1], `last` every row in order) runs through its compiled functions while they are on."""
    if step is not None:
        logits = step.forward(ids, positions, cache)
        if logits is not None:
            return logits
    x = model.embed(ids)
    tables = model._rope_tables(positions)
    for i, block in enumerate(model.blocks):
        cos, sin = tables[model.cfg.layer_is_sliding(i)]
        x = block(x, cos, sin, None, cache)
    hidden = x.reshape(-1, x.shape[-1]).index_select(0, last)
    return model.head(model.norm(hidden))
