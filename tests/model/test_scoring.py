"""The scoring forward (`OLMo.forward(score=...)`): a context's continuations packed as branches of one
row, with their own RoPE positions, score each continuation as a row of its own would, and the head
read only where asked gives the logits path's log-probs and arg-max."""

from __future__ import annotations

import warnings

import pytest
import torch

from olmo_ds.model import ModelConfig
from olmo_ds.model.attention import AttentionMask

from model_testlib import OLMO2_TINY, OLMO3_TINY, random_model

# Two rows of groups (context length, continuation lengths), then padding to the row width. OLMO3_TINY's
# window (6) is shorter than these groups, so a branch far from its context in the row but near it in
# positions must still see it: windows are measured in positions.
ROWS = [[(9, [5, 1, 7]), (12, [4, 3])], [(3, [2, 2, 2, 2]), (20, [1, 1]), (5, [9])]]
WIDTH = 48


def pack(rows, vocab: int, seed: int = 0):
    """Token rows laid out as `olmo_ds.eval.packing` lays them out, and the (context, continuation) pairs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(rows), WIDTH, dtype=torch.long)
    positions = torch.zeros_like(ids)
    branches = torch.zeros_like(ids, dtype=torch.int32)
    doc_lens = torch.zeros(len(rows), 4, dtype=torch.int32)
    index, targets, pairs = [], [], []
    for r, groups in enumerate(rows):
        at = 0
        for d, (n_ctx, conts) in enumerate(groups):
            ctx = torch.randint(1, vocab, (n_ctx,), generator=g).tolist()
            ids[r, at:at + n_ctx] = torch.tensor(ctx)
            positions[r, at:at + n_ctx] = torch.arange(n_ctx)
            branch_at, branch = at + n_ctx, 0
            for n in conts:
                cont = torch.randint(1, vocab, (n,), generator=g).tolist()
                pairs.append((ctx, cont))
                index.append(r * WIDTH + at + n_ctx - 1)
                if n > 1:
                    branch += 1
                    ids[r, branch_at:branch_at + n - 1] = torch.tensor(cont[:-1])
                    positions[r, branch_at:branch_at + n - 1] = torch.arange(n_ctx, n_ctx + n - 1)
                    branches[r, branch_at:branch_at + n - 1] = branch
                    index.extend(range(r * WIDTH + branch_at, r * WIDTH + branch_at + n - 1))
                    branch_at += n - 1
                targets.extend(cont)
            doc_lens[r, d] = branch_at - at
            at = branch_at
        doc_lens[r, len(groups)] = WIDTH - at
    return ids, positions, branches, doc_lens, torch.tensor(index), torch.tensor(targets), pairs


@pytest.mark.parametrize("spec", [OLMO2_TINY, OLMO3_TINY], ids=["olmo2", "olmo3-window"])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_branches_score_each_continuation_as_a_row_of_its_own(spec, backend):
    cfg = ModelConfig(**dict(spec, attention_backend=backend))
    model = random_model(cfg).double()
    ids, positions, branches, doc_lens, index, targets, pairs = pack(ROWS, cfg.vocab_size)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        # Half the targets replaced by the model's own arg-max, so both answers of `greedy` occur.
        alone_lp, alone_top = [], []
        for ctx, cont in pairs:
            logp = torch.log_softmax(model(torch.tensor([ctx + cont[:-1]]))[0, len(ctx) - 1:], dim=-1)
            alone_lp.append(logp)
            alone_top.append(logp.argmax(-1))
        top = torch.cat(alone_top)
        targets = torch.where(torch.arange(len(targets)) % 2 == 0, top, targets)
        got = model(ids, doc_lens=doc_lens, positions=positions, branches=branches, score=(index, targets))
    want = torch.cat(alone_lp).gather(-1, targets[:, None]).squeeze(-1)
    assert got.logprob.dtype == torch.float32
    torch.testing.assert_close(got.logprob.double(), want, rtol=0, atol=1e-5)
    assert torch.equal(got.greedy, targets == top)
    assert got.greedy.any() and not got.greedy.all()


def test_scoring_reads_the_logits_paths_numbers_at_the_asked_positions():
    cfg = ModelConfig(**OLMO2_TINY)
    model = random_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(3))
    index = torch.tensor([0, 5, 5, 41, 119, 80])  # repeats allowed; flat b * T + t
    targets = torch.tensor([7, 8, 9, 10, 299, 0])
    with torch.no_grad():
        logits = model(ids).float().reshape(-1, cfg.padded_vocab_size)[index]
        got = model(ids, score=(index, targets))
    want = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(got.logprob, want, rtol=0, atol=1e-5)
    assert torch.equal(got.greedy, logits.argmax(-1) == targets)


def test_scoring_inputs_are_checked():
    cfg = ModelConfig(**OLMO2_TINY)
    model = random_model(cfg)
    ids = torch.zeros(1, 8, dtype=torch.long)
    score = (torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(ValueError, match="beyond model.max_seq_len 64"):
        model(ids, positions=torch.full((1, 8), 64), score=score)
    with pytest.raises(ValueError, match="not both"):
        model(ids, labels=ids, score=score)
    with pytest.raises(ValueError, match="branches need doc_lens"):
        AttentionMask(1, 8, torch.device("cpu"), branches=torch.zeros(1, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"positions must have shape \[batch=1, seq_len=8\]"):
        AttentionMask(1, 8, torch.device("cpu"), positions=torch.zeros(8, dtype=torch.long))
