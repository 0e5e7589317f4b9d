"""`moe-train generate`: continue a prompt with a checkpoint's model, in one process.

The model is built from the checkpoint's own config and filled with its global tensors, so a
checkpoint of any saving layout (dp, ep, pp) loads the same way. It runs in fp32 on CUDA when
available, else on the CPU, with two inference choices that differ from training:

- routing is dropless: `model.moe.capacity_factor` would drop the token copies over an
  expert's capacity, which makes a token's output depend on the other tokens of its forward
  (and so on how a prompt is split into forwards); every copy reaches its expert here;
- the grouped GEMMs use the `torch` backend, which every device has.

The prompt is run once (prefill) and each new token alone against a KV cache. Sampling draws
on the CPU from a `torch.Generator` seeded by `seed`, so a run repeats exactly on one machine.

B batch, S positions, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from moe_checkpoint import CheckpointError, load_into, read_trainer_state, resolve_checkpoint
from moe_data import ByteTokenizer, ChatTemplate, HFTokenizer, RowError
from moe_parallel import single_process_layout
from moe_plan.config import Config, ModelConfig, config_from_dict
from moe_train.end_tokens import checkpoint_end_ids, end_of_turn_id
from moe_train.errors import MoeTrainError
from moe_train.model import Transformer
from moe_train.run_tokenizer import run_tokenizer

Tokenizer = ByteTokenizer | HFTokenizer
StopReason = Literal["eos", "end_of_turn", "length"]
"""Why generation stopped: `Generated.stop_reason`, `stop_reason` of `generate --json`."""


@dataclass
class Generated:
    checkpoint: Path
    """The checkpoint used (resolved from a checkpoints root if one was given)."""
    prompt_ids: list[int]
    ids: list[int]
    """The new tokens only; the end-of-text (or end-of-turn) token last when generation
    stopped at it."""
    text: str | None
    """The continuation decoded (end-of-text skipped); None when no tokenizer is known."""
    stop_reason: StopReason
    """``eos`` (the end-of-text token was drawn, or an end token the model directory of an
    imported checkpoint named), ``end_of_turn`` (with `chat`: the chat template's end-of-turn
    token was drawn) or ``length`` (max_new_tokens reached)."""


def generation_model(model_config: ModelConfig, seed: int = 0) -> Transformer:
    """The model of `model_config` for one process, with dropless local routing and the
    default (torch) expert GEMMs (see the module docstring); in eval mode."""
    moe = dataclasses.replace(model_config.moe, capacity_factor=None)
    config = dataclasses.replace(model_config, moe=moe)
    return Transformer(config, seed=seed).eval()


def load_checkpoint_model(
    checkpoint: str | Path, device: torch.device | str | None = None
) -> tuple[Transformer, Config, Path]:
    """The model of `checkpoint` (or of the newest one under a checkpoints root) with its
    trained weights, its training config, and the checkpoint directory."""
    from moe_train.train.state_slices import model_slices

    try:
        ckpt = resolve_checkpoint(checkpoint)
        config = config_from_dict(read_trainer_state(ckpt)["config"])
        model = generation_model(config.model, config.train.seed)
        load_into(ckpt, model_slices(model, single_process_layout(), owned_only=False))
    except CheckpointError as e:
        raise MoeTrainError(str(e)) from e
    return model.to(device or default_device()), config, ckpt


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def parse_prompt_ids(text: str, vocab_size: int) -> list[int]:
    """`1,2,3` as token ids, each below `vocab_size`."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise MoeTrainError(
            f"--prompt-ids={text!r} must be comma-separated token ids such as 1,2,3"
        ) from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise MoeTrainError(
            f"--prompt-ids holds {bad[0]}; token ids must be between 0 and "
            f"model.vocab_size - 1 = {vocab_size - 1}"
        )
    return ids


def next_token(
    logits_BV: Tensor, temperature: float, top_k: int, generator: torch.Generator
) -> Tensor:
    """[B] int64 on the CPU: the argmax when `temperature` is 0, else a draw from
    softmax(logits / temperature) over the `top_k` largest logits (all when 0)."""
    logits_BV = logits_BV.float().cpu()
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    if 0 < top_k < logits_BV.shape[-1]:
        kth_largest_B1 = logits_BV.topk(top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_largest_B1, float("-inf"))
    probs_BV = (logits_BV / temperature).softmax(dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator)[:, 0]


@torch.no_grad()
def generate_ids(
    model: Transformer,
    prompt_BS: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    eos_id: int | Sequence[int] | None = None,
    use_cache: bool = True,
) -> Tensor:
    """[B, N] the new tokens after `prompt_BS`, N <= `max_new_tokens`: stops when every
    sequence has drawn `eos_id` (or one of them, when several). `use_cache=False` runs the
    whole sequence again for each token (the reference the cache is checked against)."""
    generator = generator or torch.Generator().manual_seed(0)
    batch, prompt_len = prompt_BS.shape
    device = model.rope_cos.device
    tokens_BS = prompt_BS.to(device)
    cache = model.new_kv_cache(batch, prompt_len + max_new_tokens) if use_cache else None
    new: list[Tensor] = []
    finished_B = torch.zeros(batch, dtype=torch.bool)
    stop_ids = torch.tensor(
        [eos_id] if isinstance(eos_id, int) else list(eos_id or []), dtype=torch.long
    )
    step_input_BS = tokens_BS
    for _ in range(max_new_tokens):
        logits_BSV = model(step_input_BS, cache) if use_cache else model(tokens_BS)
        token_B = next_token(logits_BSV[:, -1], temperature, top_k, generator)
        new.append(token_B)
        if stop_ids.numel():
            finished_B |= torch.isin(token_B, stop_ids)
            if bool(finished_B.all()):
                break
        step_input_BS = token_B.to(device)[:, None]
        tokens_BS = torch.cat([tokens_BS, step_input_BS], dim=1)
    return torch.stack(new, dim=1) if new else torch.zeros(batch, 0, dtype=torch.long)


def chat_prompt(tokenizer: Tokenizer | None, prompt: str, where: Path) -> tuple[list[int], int]:
    """The ids of `prompt` as the one user message of a conversation rendered by the chat
    template of `tokenizer`'s directory with the generation prompt (as transformers'
    `apply_chat_template(..., add_generation_prompt=True)` tokenizes it), and the id of the
    template's end-of-turn token (`moe_train.end_tokens.end_of_turn_id`)."""
    if not isinstance(tokenizer, HFTokenizer):
        what = "not known here" if tokenizer is None else "the byte tokenizer"
        raise MoeTrainError(
            f"{where}: --chat needs the chat template of the run's tokenizer, which is {what}; "
            "train on data prepared with a chat model's tokenizer directory"
        )
    template = ChatTemplate(Path(tokenizer.name).parent, missing="generate without --chat")
    try:
        text = template.render([{"role": "user", "content": prompt}], generation_prompt=True)
        end_of_turn = end_of_turn_id(tokenizer, template, user=prompt)
    except RowError as e:
        raise MoeTrainError(f"--chat: {e}") from e
    if end_of_turn is None:
        raise MoeTrainError(
            f"--chat: the chat template of {template.origin} ends an assistant reply with no "
            "special token of the tokenizer, so generation would not know where a turn ends"
        )
    return [int(i) for i in tokenizer.encode(text)], end_of_turn


def _prompt_ids(
    tokenizer: Tokenizer | None,
    prompt: str | None,
    prompt_ids: Sequence[int] | str | None,
    vocab_size: int,
    ckpt: Path,
) -> list[int]:
    """The prompt as ids: `prompt` encoded by the run's tokenizer, or `prompt_ids`."""
    if prompt is not None:
        if tokenizer is None:
            raise MoeTrainError(
                f"{ckpt}: the tokenizer of the run's data.paths is not known here; "
                "give the prompt as token ids with --prompt-ids 1,2,3"
            )
        ids = [int(i) for i in tokenizer.encode(prompt)]
        if any(i >= vocab_size for i in ids):
            raise MoeTrainError(f"--prompt encodes to ids beyond model.vocab_size={vocab_size}")
        return ids
    if isinstance(prompt_ids, str):
        return parse_prompt_ids(prompt_ids, vocab_size)
    return parse_prompt_ids(",".join(str(i) for i in prompt_ids or []), vocab_size)


def generate(
    checkpoint: str | Path,
    *,
    prompt: str | None = None,
    prompt_ids: Sequence[int] | str | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    chat: bool = False,
    device: torch.device | str | None = None,
) -> Generated:
    """Continue `prompt` (text, needing the run's tokenizer) or `prompt_ids` (ids, or their
    comma-separated text) with the model of `checkpoint`; see `generate_ids`. Generation
    stops at the end tokens of `moe_train.end_tokens.checkpoint_end_ids`. `chat`: the prompt
    text is a user message put through the run's chat template (`chat_prompt`), and
    generation also stops at the template's end-of-turn token."""
    _check_generate_args(prompt, prompt_ids, chat, max_new_tokens, temperature, top_k)
    model, config, ckpt = load_checkpoint_model(checkpoint, device)
    tokenizer, eos_id = run_tokenizer(config)
    vocab_size = config.model.vocab_size
    end_of_turn = None
    if chat:
        assert prompt is not None
        ids, end_of_turn = chat_prompt(tokenizer, prompt, ckpt)
        if any(i >= vocab_size for i in [*ids, end_of_turn]):
            raise MoeTrainError(f"--chat prompt encodes to ids beyond model.vocab_size={vocab_size}")  # fmt: skip
    else:
        ids = _prompt_ids(tokenizer, prompt, prompt_ids, vocab_size, ckpt)
    if not ids:
        raise MoeTrainError("the prompt is empty; give at least one token")
    try:
        stop_ids = checkpoint_end_ids(read_trainer_state(ckpt), eos_id, end_of_turn)
    except CheckpointError as e:
        raise MoeTrainError(str(e)) from e
    new_BN = generate_ids(
        model,
        torch.tensor([ids]),
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        generator=torch.Generator().manual_seed(seed),
        eos_id=stop_ids,
    )
    new_ids = [int(i) for i in new_BN[0]]
    stop_reason = _stop_reason(new_ids, end_of_turn, stop_ids)
    text = tokenizer.decode(new_ids) if tokenizer is not None else None
    return Generated(ckpt, ids, new_ids, text, stop_reason)


def _check_generate_args(
    prompt: str | None,
    prompt_ids: Sequence[int] | str | None,
    chat: bool,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
) -> None:
    """Raise MoeTrainError (naming the CLI flag) for arguments `generate` cannot take."""
    if (prompt is None) == (prompt_ids is None):
        raise MoeTrainError("give a prompt as --prompt TEXT or as --prompt-ids 1,2,3")
    if chat and prompt is None:
        raise MoeTrainError("--chat takes the prompt as text (--prompt TEXT), a user message")
    if max_new_tokens < 0:
        raise MoeTrainError(f"--max-new-tokens={max_new_tokens} must be at least 0")
    if not temperature >= 0:
        raise MoeTrainError(f"--temperature={temperature} must be at least 0 (0: greedy)")
    if top_k < 0:
        raise MoeTrainError(f"--top-k={top_k} must be at least 0 (0: the whole vocabulary)")


def _stop_reason(new_ids: list[int], end_of_turn: int | None, stop_ids: list[int]) -> StopReason:
    """Why generation stopped: on the end-of-turn token, on another end token, or at the length."""
    last = new_ids[-1] if new_ids else None
    if last is not None and last == end_of_turn:
        return "end_of_turn"
    if last is not None and last in stop_ids:
        return "eos"
    return "length"
