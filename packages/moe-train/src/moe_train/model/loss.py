"""The language-model loss, fused with the output head over chunks of tokens.

`head_lm_loss(hidden, head_weight, targets)` is `lm_loss(hidden @ head_weight.T, targets)`
without ever holding the logits of all tokens: it runs the head product and the softmax
cross-entropy chunk by chunk (fp32 logits of one chunk at a time) and, when gradients are
needed, computes them in the same pass (the loss is the last node of the graph, so its
gradient is known up to the scale backward brings). The head's matmuls run in the compute
dtype (autocast's, or the inputs'), as an `nn.Linear` head would.

N tokens, V vocabulary, D model width; B batch, S positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_data import IGNORE_INDEX

CHUNK_LOGITS = 2**24
"""Logits per chunk (64 MiB in fp32): chunks of max(1, CHUNK_LOGITS // V) tokens."""


def lm_loss(logits_BSV: Tensor, targets_BS: Tensor) -> Tensor:
    """Mean next-token cross-entropy of given logits, computed in fp32."""
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten())


def head_lm_loss(
    hidden_BSD: Tensor,
    head_weight_VD: Tensor,
    targets_BS: Tensor,
    normalizer: Tensor | None = None,
) -> Tensor:
    """Mean next-token cross-entropy of the logits `hidden_BSD @ head_weight_VD.T`, in fp32,
    without materialising them (see the module docstring).

    With `normalizer` (a float32 scalar tensor): instead the sum of the cross-entropy over
    the targets that are not IGNORE_INDEX, divided by it; ignored targets get no gradient.
    """
    dtype = hidden_BSD.dtype
    if torch.is_autocast_enabled(hidden_BSD.device.type):
        dtype = torch.get_autocast_dtype(hidden_BSD.device.type)
    hidden_ND = hidden_BSD.reshape(-1, hidden_BSD.shape[-1]).to(dtype)
    with torch.autocast(hidden_BSD.device.type, enabled=False):
        return _HeadCrossEntropy.apply(
            hidden_ND, head_weight_VD.to(dtype), targets_BS.flatten(), normalizer
        )


class _HeadCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of `hidden_ND @ weight_VD.T` (or, given a normalizer, the sum over
    targets that are not IGNORE_INDEX divided by it); its gradients, computed in forward,
    are scaled by the loss's own gradient in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, hidden_ND: Tensor, weight_VD: Tensor, targets_N: Tensor, normalizer: Tensor | None
    ) -> Tensor:
        num_tokens, vocab = hidden_ND.shape[0], weight_VD.shape[0]
        chunk = max(1, CHUNK_LOGITS // vocab)
        trained_N = None
        denominator: int | Tensor = num_tokens
        if normalizer is not None:
            trained_N = targets_N != IGNORE_INDEX
            targets_N = torch.where(trained_N, targets_N, torch.zeros_like(targets_N))
            denominator = normalizer
        wants_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden_ND.device)
        grad_hidden_ND = torch.empty_like(hidden_ND) if wants_grad else None
        grad_weight_VD = torch.zeros_like(weight_VD, dtype=torch.float32) if wants_grad else None
        for start in range(0, num_tokens, chunk):
            rows = slice(start, min(start + chunk, num_tokens))
            logits_CV = (hidden_ND[rows] @ weight_VD.T).float()
            lse_C = torch.logsumexp(logits_CV, dim=-1)
            targets_C1 = targets_N[rows, None]
            token_loss_C = lse_C - logits_CV.gather(1, targets_C1).squeeze(1)
            if trained_N is not None:
                token_loss_C = torch.where(trained_N[rows], token_loss_C, 0.0)
            loss_sum += token_loss_C.sum()
            if not wants_grad:
                continue
            # d(mean loss)/d(logits) = (softmax - one_hot(target)) / N, in place.
            grad_logits_CV = logits_CV.sub_(lse_C[:, None]).exp_()
            grad_logits_CV.scatter_add_(1, targets_C1, torch.full_like(lse_C[:, None], -1.0))
            if trained_N is not None:
                grad_logits_CV.mul_(trained_N[rows, None])
            grad_logits_CV = grad_logits_CV.div_(denominator).to(weight_VD.dtype)
            grad_hidden_ND[rows] = grad_logits_CV @ weight_VD
            grad_weight_VD += grad_logits_CV.T @ hidden_ND[rows]
        ctx.save_for_backward(grad_hidden_ND, grad_weight_VD)
        ctx.weight_dtype = weight_VD.dtype
        return loss_sum / denominator

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:  # type: ignore[override]
        grad_hidden_ND, grad_weight_VD = ctx.saved_tensors
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = grad_hidden_ND * grad_loss.to(grad_hidden_ND.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_weight_VD * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None


@torch.no_grad()
def head_token_logprobs(normed_BSD: Tensor, head_weight_VD: Tensor, targets_BS: Tensor) -> Tensor:
    """[B, S] fp32 log-probability of each target under the logits `normed_BSD @
    head_weight_VD.T` (forward only, chunk by chunk as `head_lm_loss`, the head's matmul in
    the compute dtype)."""
    dtype = normed_BSD.dtype
    if torch.is_autocast_enabled(normed_BSD.device.type):
        dtype = torch.get_autocast_dtype(normed_BSD.device.type)
    hidden_ND = normed_BSD.reshape(-1, normed_BSD.shape[-1]).to(dtype)
    weight_VD = head_weight_VD.to(dtype)
    targets_N = targets_BS.flatten()
    chunk = max(1, CHUNK_LOGITS // weight_VD.shape[0])
    logprobs_N = torch.empty(targets_N.shape, dtype=torch.float32, device=normed_BSD.device)
    with torch.autocast(normed_BSD.device.type, enabled=False):
        for start in range(0, targets_N.numel(), chunk):
            rows = slice(start, min(start + chunk, targets_N.numel()))
            logits_CV = (hidden_ND[rows] @ weight_VD.T).float()
            target_logits_C = logits_CV.gather(1, targets_N[rows, None]).squeeze(1)
            logprobs_N[rows] = target_logits_C - torch.logsumexp(logits_CV, dim=-1)
    return logprobs_N.view(targets_BS.shape)
