"""Muon's update: momentum orthogonalised by a Newton-Schulz iteration.

For a matrix parameter W (A x B) with gradient G, momentum coefficient mu, learning rate lr
and weight decay wd, one step is

    M <- mu * M + G                      (momentum buffer)
    U  = G + mu * M                      (Nesterov)
    O  = NS5(U)                          (close to the orthogonal factor of U's polar form)
    W <- W * (1 - lr * wd) - lr * 0.2 * sqrt(max(A, B)) * O

NS5 scales U to unit Frobenius norm and applies five times the odd quintic
X <- a X + b (X X^T) X + c (X X^T)^2 X with (a, b, c) = (3.4445, -4.7750, 2.0315), which
pushes every singular value towards 1 (to about [0.7, 1.2], not exactly) while keeping the
singular vectors. A stack of matrices (an expert weight ``[E, A, B]``) is orthogonalised
matrix by matrix. The factor 0.2 * sqrt(max(A, B)) gives the update the root-mean-square
size of a typical AdamW update, so both share one learning rate (the rule of "Muon is
Scalable for LLM Training").
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""(a, b, c) of the quintic Newton-Schulz iteration."""
NS_STEPS = 5
RMS_MATCH = 0.2
"""Target root-mean-square of an update element (that of a typical AdamW update)."""


def orthogonalize(
    update: Tensor, *, steps: int = NS_STEPS, dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """`steps` quintic Newton-Schulz iterations on each matrix (the last two dimensions) of
    `update`, computed in `dtype`; returned in `update`'s dtype. Wide form inside: a tall
    matrix is transposed so that the Gram matrices are the smaller ones."""
    a, b, c = NS_COEFFICIENTS
    tall = update.size(-2) > update.size(-1)
    x = update.mT if tall else update
    norm = x.float().norm(dim=(-2, -1), keepdim=True)
    x = (x.float() / (norm + 1e-7)).to(dtype)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return (x.mT if tall else x).to(update.dtype)


def update_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """The factor on the orthogonalised update of a matrix (or stack of matrices) of
    `shape`: 0.2 * sqrt(max(rows, columns))."""
    return RMS_MATCH * math.sqrt(max(shape[-2], shape[-1]))


@torch.no_grad()
def muon_step_(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor,
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
    steps: int = NS_STEPS,
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """One Muon step on `param` (a matrix, or a stack of them in its leading dimensions),
    in place, with its `momentum_buffer` (same shape) updated in place too."""
    momentum_buffer.mul_(momentum).add_(grad)
    nesterov = grad.add(momentum_buffer, alpha=momentum)
    orthogonal = orthogonalize(nesterov, steps=steps, dtype=dtype)
    if weight_decay:
        param.mul_(1.0 - lr * weight_decay)
    param.add_(orthogonal, alpha=-lr * update_scale(param.shape))
