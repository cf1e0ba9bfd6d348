"""Cross-entropy + z-loss fused with the output projection, computed in chunks of tokens.

Why: the naive loss materialises fp32 logits for every token (vocab 100k x 16k tokens = 6.5 GB), and
autograd keeps them for the backward. Here the head's matmul, the softmax statistics and the gradients
are computed one chunk of tokens at a time inside the forward: each chunk's logits exist only while
that chunk is processed, the gradients of the hidden states and of the head weight are accumulated as
we go (the weight's in fp32), and the backward only scales them by the incoming gradient. Peak
memory is one chunk of fp32 logits plus one fp32 copy of the head weight's gradient.

Definitions (as OLMo): over the N tokens whose label is not -100,
    ce     = mean(logsumexp(logits) - logits[label])
    z_loss = z_loss_coef * mean(logsumexp(logits)^2)
    loss   = ce + z_loss
The softmax runs over every padded-vocabulary row, as in OLMo and in the exported transformers model.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
CHUNK_SIZE = 2048  # tokens per chunk: 2048 x 100,352 fp32 logits = 0.8 GB at a time


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, z_loss_coef: float, chunk_size: int):
        ctx.weight_dtype = weight.dtype
        # Softmax statistics in at least fp32 (bf16 logits would lose the loss's precision).
        acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
        # A tensor, not a Python number: no host-device sync on the token count.
        denom = (labels != IGNORE_INDEX).sum().clamp(min=1).to(acc_dtype)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32))
        ce_sum = hidden.new_zeros((), dtype=acc_dtype)
        z_sum = hidden.new_zeros((), dtype=acc_dtype)
        for start in range(0, hidden.shape[0], chunk_size):
            h = hidden[start:start + chunk_size]
            y = labels[start:start + chunk_size]
            validf = (y != IGNORE_INDEX).to(acc_dtype)
            target_ids = y.clamp(min=0)[:, None]
            logits = (h @ weight.t()).to(acc_dtype)
            target = logits.gather(1, target_ids).squeeze(1)
            # logsumexp by hand so the chunk's one fp32 [chunk, V] buffer becomes the softmax in place.
            row_max = logits.amax(dim=-1, keepdim=True)
            exp = logits.sub_(row_max).exp_()
            total = exp.sum(dim=-1)
            lse = row_max.squeeze(1) + total.log()
            ce_sum += ((lse - target) * validf).sum()
            z_sum += (lse.square() * validf).sum()
            if need_grad:
                # d/dlogits of (lse - target + c * lse^2) / N = softmax * (1 + 2c * lse) - onehot, over N.
                dlogits = exp.mul_(((1.0 + 2.0 * z_loss_coef * lse) * validf / (denom * total))[:, None])
                dlogits.scatter_add_(1, target_ids, (-validf / denom)[:, None])
                dlogits = dlogits.to(hidden.dtype)
                if grad_hidden is not None:
                    torch.matmul(dlogits, weight, out=grad_hidden[start:start + chunk_size])
                if grad_weight is not None:
                    grad_weight += dlogits.t() @ h
        ctx.save_for_backward(grad_hidden, grad_weight)
        ce = ce_sum / denom
        z = z_loss_coef * z_sum / denom
        ctx.mark_non_differentiable(ce, z)
        return ce + z, ce, z

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_z):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, z_loss_coef: float = 0.0,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, ce_loss, z_loss) of `hidden @ weight.T` against `labels`; only `loss` carries gradients.

    hidden [..., d], weight [V, d], labels [...] int64 with -100 ignored.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if labels.shape[0] != hidden.shape[0]:
        raise ValueError(f"labels have {labels.shape[0]} tokens but hidden states have {hidden.shape[0]}")
    return _FusedLinearCrossEntropy.apply(hidden, weight, labels, float(z_loss_coef), int(chunk_size))

