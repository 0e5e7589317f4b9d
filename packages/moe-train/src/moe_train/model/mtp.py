"""Multi-token prediction (DeepSeek-V3's MTP modules): extra depth that predicts further ahead.

Module k (1-based) of `model.mtp_depth` takes the hidden state h^{k-1} at position i (h^0: the
main model's last block output) and the embedding of token t_{i+k}, normalises each,
concatenates and projects them back to the model width, runs one block and gives h^k, whose
final norm and the shared output head predict token t_{i+k+1}. Each module sees k positions
fewer than the main model (those whose target lies past the sequence).

B batch, S positions, D model width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moe_plan.config import ModelConfig
from moe_train.model.attention import RMSNorm


class MTPModule(nn.Module):
    """One multi-token-prediction depth: norms, projection, block and its own final norm."""

    def __init__(self, config: ModelConfig, block: nn.Module) -> None:
        """`block`: the transformer block the module runs (a dense feed-forward one)."""
        super().__init__()
        d = config.d_model
        self.hidden_norm = RMSNorm(d, config.norm_eps)
        self.embed_norm = RMSNorm(d, config.norm_eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.block = block
        self.norm = RMSNorm(d, config.norm_eps)
        """The final norm before the shared head."""

    def forward(self, hidden_BSD: Tensor, embedded_BSD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """h^k from h^{k-1} and the embeddings of the tokens k ahead (same positions)."""
        joined = torch.cat([self.hidden_norm(hidden_BSD), self.embed_norm(embedded_BSD)], dim=-1)
        return self.block(self.proj(joined), cos, sin)
