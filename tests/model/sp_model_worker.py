"""Run by test_ulysses_attention.py under torchrun (4 CPU ranks, gloo): the model with its rows spread over 2 and 4
ranks against the same model on whole rows, in fp32.

    python -m torch.distributed.run --nproc_per_node 4 sp_model_worker.py OUT.json
    python -m torch.distributed.run --nproc_per_node 1 sp_model_worker.py OUT.json cuda   # the GPU tier's check

On a GPU (one rank, NCCL): the exchange inside compiled blocks, whose attention is flex_attention with windows and
documents, in bf16; a group of one rank makes each all-to-all a copy, so the blocks with it must train as the blocks
without it: both against the same model eager in fp32, the gradients of every weight as close as bf16 allows, which
a graph that lost the exchange's backward (zero gradients before it) would not be.

Every rank builds the same tiny OLMo 3 (sliding windows of 6 tokens in rows of 64, so windows cross the slices'
edges; YaRN; grouped-query heads) and the same batch, computes the whole-row loss and gradients itself, then the
same step with each sequence group of 2 or 4 ranks holding 1/N of every row: each rank's loss is its slice's
share of the token mean (`loss_divisor` = targets / N), and the group's gradients are averaged, as DeepSpeed
averages them. Rank 0 writes the largest difference found over all ranks, per case.
"""

import dataclasses
import json
import sys

import deepspeed
import torch
import torch.distributed as dist

from olmo_ds.model import ModelConfig, OLMo
from olmo_ds.model.loss import IGNORE_INDEX, labels_from_mask
from olmo_ds.model.sequence_parallel import SequenceParallel

from model_testlib import OLMO3_TINY

B, T = 2, 64
DOC_LENS = torch.tensor([[20, 30, 14], [64, 0, 0]])


def model_for(**overrides) -> OLMo:
    fields = dict(OLMO3_TINY, **overrides)
    torch.manual_seed(0)  # the same weights on every rank and for every variant (windows are not weights)
    return OLMo(ModelConfig(**fields)).float()


def batch(sft: bool):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, OLMO3_TINY["vocab_size"], (B, T), generator=g)
    if not sft:  # pretraining rows: every next token, the row's last predicts nothing
        labels = torch.cat([ids[:, 1:], torch.full((B, 1), IGNORE_INDEX)], dim=1)
        return ids, labels, None
    mask = torch.rand(B, T, generator=g) < 0.4  # fine-tuning: a loss mask; positions restart in each conversation
    positions = torch.cat([torch.cat([torch.arange(int(n)) for n in row if n]) for row in DOC_LENS])[None].view(B, T)
    return ids, labels_from_mask(ids, mask), positions


def step(model, ids, labels, positions, sp=None):
    model.zero_grad()
    kwargs = dict(labels=labels, doc_lens=DOC_LENS, positions=positions)
    if sp is None:
        out = model(ids, **kwargs)
    else:
        targets = torch.tensor(float((labels != IGNORE_INDEX).sum()))
        out = model(sp.local(ids), **dict(kwargs, labels=sp.local(labels)), loss_divisor=targets / sp.size, sequence_parallel=sp)
    out.loss.backward()
    loss, grads = out.loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}
    if sp is not None:  # as DeepSpeed: the gradients averaged over the ranks; the loss shares averaged as the trainer logs them
        for t in (loss, *grads.values()):
            dist.all_reduce(t, group=sp.group)
            t /= sp.size
    return float(loss), grads


def rel(a: dict, b: dict) -> float:
    return float(sum((a[k] - b[k]).norm() ** 2 for k in a) ** 0.5 / sum(b[k].norm() ** 2 for k in b) ** 0.5)


def gpu_check(path: str) -> None:
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    deepspeed.init_distributed(dist_backend="nccl")
    sp = SequenceParallel.of(dist.new_group([0]))
    cfg = ModelConfig(**dict(OLMO3_TINY, sliding_window=256, max_seq_len=2048, compile="blocks"))
    torch.manual_seed(0)
    model = OLMo(cfg).cuda().bfloat16()
    truth = OLMo(dataclasses.replace(cfg, compile="eager")).cuda().float()  # the same weights, eager fp32: the reference
    truth.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, OLMO3_TINY["vocab_size"], (2, 1024), generator=g).cuda()
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE_INDEX, device="cuda")], dim=1)
    doc_lens = torch.tensor([[300, 524, 200], [1024, 0, 0]]).cuda()
    from olmo_ds.model.model import BLOCK_CALLS

    def run(m, **kwargs):
        m.zero_grad()
        before = BLOCK_CALLS["compiled"]
        out = m(ids, labels=labels, doc_lens=doc_lens, **kwargs)
        out.loss.backward()
        return float(out.loss.detach()), {n: p.grad.float().clone() for n, p in m.named_parameters()}, BLOCK_CALLS["compiled"] - before

    ref_loss, ref_grads, _ = run(truth)
    report = {}
    for name, kwargs in (("plain", {}), ("exchange", {"sequence_parallel": sp})):
        loss, grads, compiled = run(model, **kwargs)
        report[name] = {"compiled": compiled, "loss_diff": abs(loss - ref_loss),
                        "grad_rel": {n: float((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()) for n in grads}}
    with open(path, "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


def main():
    if len(sys.argv) > 2 and sys.argv[2] == "cuda":
        return gpu_check(sys.argv[1])
    dist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {}
    for size in (2, 4):
        for first in range(0, world, size):
            group = dist.new_group(list(range(first, first + size)))
            if first <= rank < first + size:
                groups[size] = SequenceParallel.of(group)
    cases = {}
    for size in (2, 4):
        for kv in (4, 2, 1):
            for sft in (False, True):
                cases[f"sp{size} kv{kv} {'sft' if sft else 'pretrain'}"] = (size, dict(n_kv_heads=kv), sft)
    cases["sp2 kv2 sft checkpointed"] = (2, dict(activation_checkpointing="full"), True)
    results = {}
    for name, (size, overrides, sft) in cases.items():
        model = model_for(**overrides)
        ids, labels, positions = batch(sft)
        ref_loss, ref_grads = step(model, ids, labels, positions)
        loss, grads = step(model, ids, labels, positions, groups[size])
        err = torch.tensor([abs(loss - ref_loss), rel(grads, ref_grads)], dtype=torch.float64)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        results[name] = {"loss": ref_loss, "loss_diff": float(err[0]), "grad_rel": float(err[1])}
        if name == "sp2 kv2 sft":  # the same model without its windows, against the windowed rows spread over ranks
            plain = model_for(n_kv_heads=2, sliding_window=None, sliding_window_pattern=[])
            no_loss, no_grads = step(plain, ids, labels, positions)
            results["without windows"] = {"loss_diff": abs(no_loss - loss), "grad_rel": rel(no_grads, grads)}
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


main()
