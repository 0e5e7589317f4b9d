"""Decoder-only MoE transformer: embedding, pre-norm blocks, output head.

B batch, S positions of this call, V vocabulary, D model width.
"""

import math
import zlib
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from moe_data import IGNORE_INDEX
from moe_plan.config import ModelConfig
from moe_train.model.attention import Attention, LayerKVCache, RMSNorm, rope_tables
from moe_train.model.documents import Documents
from moe_train.model.loss import head_lm_loss
from moe_train.model.moe import AttachAuxLoss, Experts, MoEFeedForward, SwiGLU
from moe_train.model.mtp import MTPModule
from moe_train.model.recompute import RecomputeMode, run_with_recompute
from moe_train.model.sequence_part import WHOLE_SEQUENCES, SequencePart, values_ahead


class KVCache:
    """Keys and values of every attention layer for the positions a model has processed, so
    that inference runs each new token once instead of the whole sequence again.

    Built by `Transformer.new_kv_cache`; `Transformer.forward(tokens, cache)` reads the
    positions before `length`, appends those of `tokens` and advances `length`.
    """

    def __init__(self, layers: dict[str, LayerKVCache], capacity: int) -> None:
        self.layers = layers
        self.capacity = capacity
        """Positions it has room for."""
        self.length = 0
        """Positions processed so far."""


class Block(nn.Module):
    """Transformer block: attention then a dense or MoE feed-forward, each with an RMSNorm on
    its input (pre-norm) or on its output (`model.norm_placement`)."""

    def __init__(self, config: ModelConfig, layer: int, *, dense: bool = False):
        """Block `layer` (global index); its feed-forward is dense for the first
        `config.dense_layers` blocks, or when `dense`, else MoE."""
        super().__init__()
        self.recompute: RecomputeMode = "none"
        """What backward recomputes (set on a built model by `apply_recompute`)."""
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(
            config.d_model,
            config.n_heads,
            config.n_kv_heads,
            qk_norm=config.qk_norm,
            norm_eps=config.norm_eps,
            qkv_bias=config.qkv_bias,
        )
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.norm_output = config.norm_placement == "output"
        """The norms act on the outputs of attention and feed-forward (`model.norm_placement`)."""
        self.ffn: nn.Module
        if dense or layer < config.dense_layers:
            self.ffn = SwiGLU(config.d_model, config.dense_hidden)
        else:
            self.ffn = MoEFeedForward(config.d_model, config.moe)

    def forward(
        self,
        x_BSD: Tensor,
        cos: Tensor,
        sin: Tensor,
        cache: LayerKVCache | None = None,
        start: int = 0,
        documents: Documents | None = None,
    ) -> Tensor:
        """`documents` (no cache): attention stays inside each document."""
        if cache is not None:  # inference: nothing to recompute
            return self._forward(x_BSD, cos, sin, None, cache, start)
        return run_with_recompute(self._forward, self.recompute, x_BSD, cos, sin, documents)

    def _forward(
        self,
        x_BSD: Tensor,
        cos: Tensor,
        sin: Tensor,
        documents: Documents | None = None,
        cache: LayerKVCache | None = None,
        start: int = 0,
    ) -> Tensor:
        if self.norm_output:  # OLMo-2's placement: the sublayers' outputs are normalised
            attended = self.attn(x_BSD, cos, sin, cache, start, documents)
            x_BSD = x_BSD + self.attn_norm(attended)
            return x_BSD + self.ffn_norm(self.ffn(x_BSD))
        attended = self.attn(self.attn_norm(x_BSD), cos, sin, cache, start, documents)
        x_BSD = x_BSD + attended
        return x_BSD + self.ffn(self.ffn_norm(x_BSD))


class Transformer(nn.Module):
    """The language model, or the part of it one rank holds.

    `Transformer(config)` is the whole single-process model, built from its config alone. A
    rank's part of a parallel layout is this model transformed after construction
    (`moe_train.parallelize`): built on the meta device, given its experts and dispatchers,
    its part of each sequence and its pipeline stages, then materialised. `forward(tokens)` gives
    logits (whole model only); `run_layers` runs any part. The MoE auxiliary losses join the
    backward through the MoE blocks themselves (see `set_aux_loss_scale`), so the training
    objective is the LM loss alone. Training choices are applied to the built model
    (`training_choices`).
    """

    def __init__(self, config: ModelConfig, *, seed: int = 0) -> None:
        """Parameters initialised from `seed` (see `init_weights`); on the meta device (under
        `torch.device("meta")`) left unallocated and uninitialised. Any sequence length runs:
        the rotary tables grow to the longest sequence seen (see `rope`)."""
        super().__init__()
        self.config = config
        self.embed: nn.Embedding | None = nn.Embedding(config.vocab_size, config.d_model)
        # A dict keyed by the global layer index keeps parameter names stable when a pipeline
        # stage holds only some of the layers.
        self.blocks = nn.ModuleDict({str(i): Block(config, i) for i in range(config.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.d_model, config.norm_eps)
        self.head: nn.Linear | None = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.mtp = nn.ModuleDict(
            {
                str(k): MTPModule(config, Block(config, config.n_layers + k, dense=True))
                for k in range(config.mtp_depth)
            }
        )
        """The multi-token-prediction modules (`moe_train.model.mtp`), on the module holding
        the head; they share the embedding and the head."""
        self.mtp_loss_scale = 1.0
        """Gradient of the training objective with respect to the MTP loss (see
        `set_aux_loss_scale`)."""
        self.register_buffer(
            "step_mtp_loss", torch.zeros((), dtype=torch.float64), persistent=False
        )
        self.last_mtp_loss: Tensor | None = None
        self.tie_weights()
        empty = torch.empty(0, config.d_model // config.n_heads // 2)
        self.register_buffer("rope_cos", empty, persistent=False)
        self.register_buffer("rope_sin", empty.clone(), persistent=False)
        self.sequence: SequencePart = WHOLE_SEQUENCES
        """The part of each sequence that inputs and targets hold (whole sequences unless a
        layout splits them, see `SequencePart`)."""
        if not self.rope_cos.is_meta:
            self.init_weights(seed)

    def tie_weights(self) -> None:
        """Share the embedding with the head when `model.tie_embeddings` (and both are held)."""
        if self.config.tie_embeddings and self.head is not None and self.embed is not None:
            self.head.weight = self.embed.weight

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Normal(0, init_std) weights; residual output projections scaled by 1/sqrt(2L);
        zero biases (q/k/v); buffers at their starting values (empty rotary tables, zero
        balancing biases and routing statistics).

        Every tensor (every expert of an expert tensor) draws from its own generator seeded by
        `seed` and its global name (and global expert index), so a weight is the same
        whichever ranks hold it, on whatever device, and whatever else the process builds.
        """
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_output = name.endswith(("attn.out", ".down"))
                _seeded_normal(module.weight, f"{name}.weight", seed, out_std if is_output else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                _seeded_normal(module.weight, f"{name}.weight", seed, std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, Experts):
                first = module.first_expert
                for local, expert in enumerate(range(first, first + module.num_experts)):
                    _seeded_normal(
                        module.w_gate_up_EDO[local], f"{name}.w_gate_up_EDO.{expert}", seed, std
                    )
                    _seeded_normal(
                        module.w_down_EHD[local], f"{name}.w_down_EHD.{expert}", seed, out_std
                    )
            elif isinstance(module, MoEFeedForward):
                module.reset_buffers()
        self.step_mtp_loss.zero_()
        self.rope_cos = self.rope_cos.new_empty(0, self.rope_cos.shape[1])
        self.rope_sin = self.rope_sin.new_empty(0, self.rope_sin.shape[1])

    def rope(self, length: int) -> tuple[Tensor, Tensor]:
        """cos and sin tables of the rotary embedding for at least `length` positions, on the
        model's device. Extending them keeps the rows they hold: a position's angles do not
        depend on the table's length, and are computed on the CPU whatever the device, so
        every process gets the same values."""
        if length > self.rope_cos.shape[0]:
            config = self.config
            cos, sin = rope_tables(
                config.d_model // config.n_heads, length, config.rope_theta, config.rope_scaling
            )
            self.rope_cos = cos.to(self.rope_cos.device)
            self.rope_sin = sin.to(self.rope_sin.device)
        return self.rope_cos, self.rope_sin

    def forward(
        self,
        tokens_BS: Tensor,
        cache: KVCache | None = None,
        *,
        targets_BS: Tensor | None = None,
        documents: Documents | None = None,
        loss_normalizer: Tensor | None = None,
    ) -> Tensor:
        """Logits [B, S, V] of `tokens_BS`; with a `cache`, the tokens continue the
        `cache.length` positions it holds (inference only: see `new_kv_cache`). With
        `targets_BS`, instead the mean next-token cross-entropy of the predictions for them
        (fp32), the head fused into the loss: the logits of all tokens never exist. With
        `documents` (where the documents of each row end, see `Documents.of`), each position
        attends only to its own document, as if each document ran alone. With
        `loss_normalizer`, the loss is instead the sum over the targets that are not
        IGNORE_INDEX divided by it (see `head_lm_loss`)."""
        if self.embed is None or self.head is None or len(self.blocks) != self.config.n_layers:
            raise ValueError("forward needs the whole model; use run_layers on a part of it")
        if cache is not None and (targets_BS is not None or documents is not None):
            raise ValueError("forward takes targets or documents, or a KV cache, not both")
        if cache is not None and self.sequence.parts > 1:
            raise ValueError("a KV cache needs whole sequences, not a part of each")
        if targets_BS is not None:
            embedded_BSD = self.embed(tokens_BS)
            x_BSD = self.run_layers(embedded_BSD, list(self.blocks), documents=documents)
            loss = self.head_loss(x_BSD, targets_BS, loss_normalizer)
            return self.with_mtp_loss(loss, x_BSD, embedded_BSD, targets_BS)
        if cache is None:
            return self.run_layers(
                tokens_BS, list(self.blocks), embed=True, head=True, documents=documents
            )
        start, end = cache.length, cache.length + tokens_BS.shape[1]
        if end > cache.capacity:
            raise ValueError(
                f"{end} positions do not fit a KV cache of {cache.capacity}; make a larger one"
            )
        x_BSD = self.embed(tokens_BS)
        cos, sin = self.rope(cache.capacity)
        for name, block in self.blocks.items():
            x_BSD = block(x_BSD, cos, sin, cache.layers[name], start)
        cache.length = end
        return self.head(self.norm(x_BSD))

    def head_loss(
        self, x_BSD: Tensor, targets_BS: Tensor, normalizer: Tensor | None = None
    ) -> Tensor:
        """The final norm, the head and the cross-entropy, fused (see `forward`)."""
        if self.head is None:
            raise ValueError("head_loss needs the module holding the head (the last stage)")
        return head_lm_loss(self.norm(x_BSD), self.head.weight, targets_BS, normalizer)

    def with_mtp_loss(
        self, lm_loss: Tensor, hidden_BSD: Tensor, embedded_BSD: Tensor, targets_BS: Tensor
    ) -> Tensor:
        """`lm_loss`, carrying into backward the MTP loss of the main model's last hidden
        state `hidden_BSD` (before the final norm) for inputs embedded as `embedded_BSD`
        (unchanged without MTP modules). The MTP loss, the mean over modules of their
        next-but-k cross-entropies, is left in `last_mtp_loss` and summed over training
        forwards into `step_mtp_loss` (`take_mtp_loss`).

        Module k runs on every position held, reading the embedding and the target k
        positions further along (`values_ahead`, which crosses to the rank holding them
        under context parallelism); the last k positions of each sequence have none, and
        their targets are ignored. Each module's loss is its sum over this part's targets
        divided by the whole batch's (B x (S - k)), so the parts of a sequence add up to
        its mean. Under the causal mask a position sees only earlier ones, so the ignored
        positions change nothing the others compute."""
        if not self.mtp:
            return lm_loss
        if self.head is None or len(self.mtp) != self.config.mtp_depth:
            raise ValueError("the MTP loss needs the module holding the head")
        batch, held = hidden_BSD.shape[:2]
        whole = held * self.sequence.parts
        cos, sin = self.rope(whole)
        cos, sin = self.sequence.rows(cos, held), self.sequence.rows(sin, held)
        losses, h_BSD = [], hidden_BSD
        for k, module in enumerate(self.mtp.values(), start=1):
            h_BSD = module(h_BSD, values_ahead(self.sequence, embedded_BSD, k, 0.0), cos, sin)
            targets_k_BS = values_ahead(self.sequence, targets_BS, k, IGNORE_INDEX)
            # The targets of the whole batch, made on the device (no copy from the host).
            normalizer = torch.full(
                (), batch * (whole - k), dtype=torch.float32, device=h_BSD.device
            )
            losses.append(
                head_lm_loss(module.norm(h_BSD), self.head.weight, targets_k_BS, normalizer)
            )
        mtp_loss = torch.stack(losses).mean()
        self.last_mtp_loss = mtp_loss.detach()
        if self.training:
            self.step_mtp_loss += self.last_mtp_loss.double()
        if mtp_loss.requires_grad:
            lm_loss = AttachAuxLoss.apply(lm_loss, mtp_loss, self.mtp_loss_scale)
        return lm_loss

    @torch.no_grad()
    def take_mtp_loss(self) -> Tensor:
        """The sum of the MTP losses of the training forwards since the last call (float64
        scalar; zero without MTP modules); clears it."""
        total = self.step_mtp_loss.clone()
        self.step_mtp_loss.zero_()
        return total

    def new_kv_cache(self, batch: int, capacity: int, dtype: torch.dtype | None = None) -> KVCache:
        """An empty KV cache for `batch` sequences of up to `capacity` positions, in `dtype`
        (default: the attention weights' dtype)."""
        layers = {}
        for name, block in self.blocks.items():
            attn = block.attn
            weight = attn.qkv.weight
            shape = (batch, attn.n_kv_heads, capacity, attn.head_dim)
            layers[name] = LayerKVCache(
                torch.empty(shape, dtype=dtype or weight.dtype, device=weight.device),
                torch.empty(shape, dtype=dtype or weight.dtype, device=weight.device),
            )
        return KVCache(layers, capacity)

    def run_layers(
        self,
        x: Tensor,
        layers: Sequence[str],
        *,
        embed: bool = False,
        head: bool = False,
        documents: Documents | None = None,
    ) -> Tensor:
        """Embed tokens (if `embed`), run the named blocks in order, apply the head (if `head`);
        with `documents`, attention stays inside each document. `x` holds the positions
        `sequence` says, and `documents` are those of the whole sequences."""
        cos, sin = self.rope(x.shape[1] * self.sequence.parts)
        cos, sin = self.sequence.rows(cos, x.shape[1]), self.sequence.rows(sin, x.shape[1])
        if embed:
            x = self.embed(x)
        for layer in layers:
            x = self.blocks[layer](x, cos, sin, documents=documents)
        return self.head(self.norm(x)) if head else x

    def moe_layers(self) -> dict[int, MoEFeedForward]:
        """The MoE feed-forward modules this module holds, by global layer index."""
        return {
            int(index): block.ffn
            for index, block in self.blocks.items()
            if isinstance(block.ffn, MoEFeedForward)
        }

    def set_aux_loss_scale(self, scale: float) -> None:
        """Make the MoE auxiliary losses contribute `scale` times their mean over MoE layers.

        With the default 1.0, backward of the LM loss of one forward is backward of
        `lm + lb_loss_weight * mean(lb) + z_loss_weight * mean(z) + mtp_loss_weight * mtp`;
        under gradient
        accumulation over n micro-batches pass 1/n, as for the LM loss.
        """
        num_moe_layers = self.config.n_layers - self.config.dense_layers
        for layer in self.moe_layers().values():
            layer.aux_loss_scale = scale / num_moe_layers
        self.mtp_loss_scale = scale * self.config.mtp_loss_weight

    def aux_losses(self) -> tuple[Tensor, Tensor]:
        """Unweighted load-balancing and z-loss of the latest forward, mean over MoE layers.

        Detached values for inspection; their gradients flow through the forward itself.
        """
        layers = list(self.moe_layers().values())
        if not layers or layers[0].last_lb_loss is None:
            zero = torch.zeros((), device=self.rope_cos.device)
            return zero, zero
        lb = torch.stack([m.last_lb_loss for m in layers]).mean()
        z = torch.stack([m.last_z_loss for m in layers]).mean()
        return lb, z


def _seeded_normal(tensor: Tensor, name: str, seed: int, std: float) -> None:
    """Fill `tensor` from N(0, std^2) with a CPU generator seeded by (`seed`, `name`): the
    values are drawn on the CPU whatever the tensor's device, so they are the same on every
    device (one tensor at a time passes through host memory)."""
    generator = torch.Generator()
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    if tensor.device.type == "cpu":
        tensor.normal_(0.0, std, generator=generator)
    else:
        drawn = torch.empty(tensor.shape, dtype=tensor.dtype).normal_(0.0, std, generator=generator)
        tensor.copy_(drawn)
