"""Preference tuning's exactness, CPU fp32 (issue 45): pairs of real conversations (shared/data/pref-sample, OLMo 3
template, dolma2 tokenizer, each side masked to its final reply) packed into rows, through our model's
per-document log-probabilities and `preference_loss`, against a random transformers `Olmo3ForCausalLM` (its
weights loaded into ours through `olmo_ds.weights`) run on each side alone, with the published formulas."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from olmo_ds.model import OLMo
from olmo_ds.model.config import ModelConfig
from olmo_ds.model.hf import to_hf_config
from olmo_ds.model.loss import IGNORE_INDEX, PREFERENCE_LOSSES, document_logprobs, labels_from_mask, preference_loss
from olmo_ds.weights import load_weights

from model_testlib import OLMO3_TINY
from sft_testlib import tokenizer

from testdata import SHARED

PREFS = SHARED / "data" / "pref-sample"
SEQ = 640
BETA = 0.1


@functools.cache
def pairs(limit: int = 12) -> tuple:
    """((chosen ids, chosen labels), (rejected ids, rejected labels)) of pref-sample's first pairs that fit SEQ
    together, each side masked to its final assistant reply (ChatEncoder's "last" mask)."""
    from olmo_ds.chat import ChatEncoder, load_chat_template

    tok = tokenizer()
    enc = ChatEncoder(load_chat_template("olmo3", tok), tok, mask="last")
    out = []
    for line in (PREFS / "train.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        sides = []
        for key in ("chosen", "rejected"):
            e = enc.encode(row[key])
            ids = torch.as_tensor(e.ids.astype(np.int64))
            sides.append((ids, labels_from_mask(ids, torch.as_tensor(e.mask))))
        if sum(len(s[0]) for s in sides) <= SEQ // 2:
            out.append(tuple(sides))
        if len(out) == limit:
            break
    return tuple(out)


def packed_rows(batch_pairs) -> dict[str, torch.Tensor]:
    """Pairs placed first-fit into rows of SEQ tokens, as few as they need (chosen then rejected, then padding as
    its own piece); "order": the pair index of each pair in row-major order."""
    sizes = [sum(len(s[0]) for s in pair) for pair in batch_pairs]
    fill: list[int] = []
    placed: list[list[int]] = []
    for k, size in enumerate(sizes):
        r = next((r for r in range(len(fill)) if fill[r] + size <= SEQ), len(fill))
        if r == len(fill):
            fill.append(0)
            placed.append([])
        fill[r] += size
        placed[r].append(k)
    rows = len(fill)
    ids = torch.zeros(rows, SEQ, dtype=torch.int64)
    labels = torch.full((rows, SEQ), IGNORE_INDEX, dtype=torch.int64)
    positions = torch.zeros(rows, SEQ, dtype=torch.int64)
    lens: list[list[int]] = [[] for _ in range(rows)]
    for r, ks in enumerate(placed):
        at = 0
        for side_ids, side_labels in (side for k in ks for side in batch_pairs[k]):
            n = len(side_ids)
            ids[r, at:at + n], labels[r, at:at + n], positions[r, at:at + n] = side_ids, side_labels, torch.arange(n)
            lens[r].append(n)
            at += n
        if at < SEQ:
            positions[r, at:] = torch.arange(SEQ - at)
            lens[r].append(SEQ - at)
    width = max(len(x) for x in lens)
    doc_lens = torch.tensor([x + [0] * (width - len(x)) for x in lens], dtype=torch.int32)
    return {"input_ids": ids, "labels": labels, "positions": positions, "doc_lens": doc_lens,
            "order": [k for row in placed for k in row],
            "pairs_per_row": [len(row) for row in placed]}


@functools.cache
def _hf_dir(tmp_root: str, seed: int) -> Path:
    import transformers

    cfg = ModelConfig(**{**OLMO3_TINY, "vocab_size": tokenizer().vocab_size, "max_seq_len": SEQ, "d_model": 32,
                         "n_layers": 3, "n_heads": 2, "n_kv_heads": 1, "mlp_hidden": 48})
    config = transformers.AutoConfig.for_model(**{**to_hf_config(cfg), "initializer_range": 0.2})
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    out = Path(tmp_root) / f"hf-{seed}"
    hf.save_pretrained(out, safe_serialization=True)
    return out


def models(tmp_root: str, seed: int):
    """(transformers Olmo3ForCausalLM, our OLMo with its weights through `olmo_ds.weights.load_weights`), fp32 eval."""
    import transformers

    directory = _hf_dir(tmp_root, seed)
    weights = load_weights(directory)
    ours = OLMo(weights.provenance.cfg)
    ours.load_state_dict(weights.state_dict)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    return hf.eval(), ours.eval()


def hf_side_logprob(hf, ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """log pi(reply | prompt) of one conversation alone, in float64 from transformers' logits, and its token count."""
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids[None]).logits[0].double(), dim=-1)
    keep = labels != IGNORE_INDEX
    return float(logp[keep].gather(1, labels[keep][:, None]).sum()), int(keep.sum())


def published(kind: str, pc, pr, rc, rr, nc, nr, beta=BETA, eps=0.0, gamma=0.0) -> tuple[float, float, float]:
    """(loss, chosen reward, rejected reward) of one pair, written from the papers (Python floats, no torch)."""
    logsig = lambda x: -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))  # noqa: E731
    if kind in ("dpo_norm", "simpo"):
        pc, pr, rc, rr = pc / nc, pr / nr, rc / nc, rr / nr
    if kind == "simpo":
        cr, rj = beta * pc, beta * pr
        h = cr - rj - gamma
    else:
        cr, rj = beta * (pc - rc), beta * (pr - rr)
        h = cr - rj
    if kind == "ipo":
        return ((pc - pr) - (rc - rr) - 1 / (2 * beta)) ** 2, cr, rj
    return -(1 - eps) * logsig(h) - eps * logsig(-h), cr, rj


def our_sides(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair (row-major, pairs in row order): (logprob [P, 2], tokens [P, 2]) from one per-document forward."""
    out = model(batch["input_ids"], labels=batch["labels"], doc_lens=batch["doc_lens"], positions=batch["positions"],
                per_document=True)
    lp, n = [], []
    for r in range(batch["input_ids"].shape[0]):
        docs = 2 * batch["pairs_per_row"][r]
        lp.append(out.logprob[r, :docs].view(-1, 2))
        n.append(out.tokens[r, :docs].view(-1, 2))
    return torch.cat(lp), torch.cat(n)


@functools.cache
def _packed_and_transformers(tmp_root: str):
    """Our per-document sums of the packed pairs, and per pair (in the same order) transformers' summed
    log-probabilities of each side alone under the policy and the reference (a second random model, as a frozen
    starting model would be) and the token counts: computed once for every loss kind."""
    hf, ours = models(tmp_root, 0)
    hf_ref, _ = models(tmp_root, 1)
    data = pairs()
    batch = packed_rows(data)
    with torch.no_grad():
        lp, n = our_sides(ours, batch)
    want = []
    for k in batch["order"]:
        (ci, cl), (ri, rl) = data[k]
        (pc, nc), (pr, nr) = hf_side_logprob(hf, ci, cl), hf_side_logprob(hf, ri, rl)
        want.append((pc, pr, hf_side_logprob(hf_ref, ci, cl)[0], hf_side_logprob(hf_ref, ri, rl)[0], nc, nr))
    return batch, lp, n, want


@pytest.mark.parametrize("kind", PREFERENCE_LOSSES)
def test_packed_pairs_equal_transformers_pair_by_pair(tmp_path_factory, kind):
    """Loss and rewards of every packed pair == the published formula on transformers' log-probabilities of each
    side alone, within 1e-5."""
    batch, lp, n, want = _packed_and_transformers(str(tmp_path_factory.getbasetemp()))
    eps = 0.1 if kind == "dpo" else 0.0
    for i, (pc, pr, _, _, nc, nr) in enumerate(want):
        assert (int(n[i, 0]), int(n[i, 1])) == (nc, nr)
        assert abs(float(lp[i, 0]) - pc) <= 1e-5 * max(1.0, abs(pc)) and abs(float(lp[i, 1]) - pr) <= 1e-5 * max(1.0, abs(pr))
    ref = torch.tensor([w[2:4] for w in want])
    got = preference_loss(kind, lp[:, 0], lp[:, 1], ref[:, 0], ref[:, 1], n[:, 0], n[:, 1], beta=BETA,
                          label_smoothing=eps, simpo_gamma=0.05)
    for i, w in enumerate(want):
        loss, cr, rj = published(kind, *w, eps=eps, gamma=0.05)
        assert abs(float(got.losses[i]) - loss) <= 1e-5 * max(1.0, abs(loss)), (i, float(got.losses[i]), loss)
        assert abs(float(got.chosen_rewards[i]) - cr) <= 1e-5 * max(1.0, abs(cr))
        assert abs(float(got.rejected_rewards[i]) - rj) <= 1e-5 * max(1.0, abs(rj))


def test_without_document_masks_the_sums_differ(tmp_path_factory):
    """The exactness check can fail: with each row one document (no masks between the sides and pairs), the
    per-side sums move far beyond its tolerance."""
    batch, lp, _, _ = _packed_and_transformers(str(tmp_path_factory.getbasetemp()))
    _, ours = models(str(tmp_path_factory.getbasetemp()), 0)
    rows = len(batch["doc_lens"])
    with torch.no_grad():
        leaky = ours(batch["input_ids"], labels=batch["labels"], doc_lens=torch.full((rows, 1), SEQ, dtype=torch.int32),
                     positions=torch.arange(SEQ).expand(rows, SEQ), per_document=True)
    assert not torch.allclose(leaky.logprob.sum(), lp.sum(), rtol=1e-4)


def test_sides_and_pairs_do_not_see_each_other(tmp_path_factory):
    """Changing a pair's rejected prompt leaves its chosen side's log-probability alone; perturbing one pair changes
    its own loss and no other pair's."""
    _, ours = models(str(tmp_path_factory.getbasetemp()), 0)
    data = pairs()
    batch = packed_rows(data)
    with torch.no_grad():
        base, n = our_sides(ours, batch)
    lens = batch["doc_lens"][0]
    start = int(lens[:2].sum())  # row 0's second pair: docs 2 (chosen) and 3 (rejected); change doc 3
    changed = batch["input_ids"].clone()
    changed[0, start + int(lens[2]) + 3:start + int(lens[2]) + 8] = 1234  # inside the rejected side's prompt
    with torch.no_grad():
        after, _ = our_sides(ours, {**batch, "input_ids": changed})
    ref = torch.zeros_like(base)
    def losses(lp):
        return preference_loss("dpo", lp[:, 0], lp[:, 1], ref[:, 0], ref[:, 1], n[:, 0], n[:, 1], beta=BETA).losses
    moved = (losses(after) != losses(base)).nonzero().squeeze(1).tolist()
    assert moved == [1], moved  # entry 1 of row-major order: row 0's second pair
    assert after[1, 0] == base[1, 0] and after[1, 1] != base[1, 1]  # its chosen side did not see the change


def test_fused_gradients_equal_autograd_on_full_logits(tmp_path_factory):
    """The gradients of every weight through the chunked per-document path (chunks of 37 positions) equal autograd
    through full fp32 logits and log_softmax, for a DPO loss over packed pairs (1e-6 relative)."""
    _, ours = models(str(tmp_path_factory.getbasetemp()), 0)
    ours.train()
    data = pairs()
    batch = packed_rows(data[:6])
    ref = torch.randn(6, 2) * 3 - 40

    def loss_of(lp, n):
        return preference_loss("dpo_norm", lp[:, 0], lp[:, 1], ref[:, 0], ref[:, 1], n[:, 0], n[:, 1], beta=BETA).losses.sum()

    ours.head.forward = functools.partial(type(ours.head).forward, ours.head, chunk_size=37)
    lp, n = our_sides(ours, batch)
    loss_of(lp, n).backward()
    fused = {k: p.grad.clone() for k, p in ours.named_parameters()}
    del ours.head.forward
    ours.zero_grad()
    logits = ours(batch["input_ids"], doc_lens=batch["doc_lens"], positions=batch["positions"]).float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, batch["labels"].clamp(min=0)[..., None]).squeeze(-1)
    logp = logp * (batch["labels"] != IGNORE_INDEX)
    ends = batch["doc_lens"].long().cumsum(1)
    sides = []
    for r in range(len(batch["doc_lens"])):
        for d in range(2 * batch["pairs_per_row"][r]):
            lo = int(ends[r, d - 1]) if d else 0
            sides.append(logp[r, lo:int(ends[r, d])].sum())
    loss_of(torch.stack(sides).view(-1, 2), n).backward()
    for k, p in ours.named_parameters():
        scale = p.grad.abs().max().clamp(min=1e-12)
        assert (fused[k] - p.grad).abs().max() <= 1e-6 * scale + 1e-9, k
    assert any(g.abs().max() > 0 for g in fused.values())


def test_document_logprobs_chunks_and_dtype():
    """The chunked function against a direct computation on random tensors: chunk sizes that do and do not divide
    the positions, and bf16 inputs (softmax statistics in fp32: the sums stay within bf16's logit rounding)."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(50, 16), torch.randn(300, 16)
    labels = torch.randint(0, 300, (50,))
    labels[::3] = IGNORE_INDEX
    docs = torch.arange(50) // 10
    want = torch.zeros(5, dtype=torch.float64).index_add(
        0, docs[labels >= 0], torch.log_softmax((hidden @ weight.t()).double(), -1)[labels >= 0].gather(1, labels[labels >= 0, None]).squeeze(1))
    for chunk in (1, 7, 50, 4096):
        got, tokens = document_logprobs(hidden, weight, labels, docs, 5, chunk_size=chunk)
        assert torch.allclose(got.double(), want, rtol=1e-5), chunk
        assert tokens.tolist() == [int(((labels >= 0) & (docs == d)).sum()) for d in range(5)]
    low, _ = document_logprobs(hidden.bfloat16(), weight.bfloat16(), labels, docs, 5)
    assert low.dtype == torch.float32 and torch.allclose(low.double(), want, rtol=3e-2)
