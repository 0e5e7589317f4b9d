"""`moe-train generate --chat`: the prompt goes through the run's chat template as
transformers renders it, and generation stops at the template's end-of-turn token, as the
export's does in transformers."""

import json

import pytest
import torch
from generate_checks import assert_refused_in_one_line, bpe_text_checkpoint
from test_chat_data import (
    CONVERSATIONS,
    LLAMA_SPECIALS,
    LLAMA_TEMPLATE,
    QWEN_SPECIALS,
    QWEN_TEMPLATE,
    _tokenizer_dir,
)

from moe_data.conversations import prepare_conversations
from moe_data.tokenizer import HFTokenizer
from moe_plan.config import config_from_dict
from moe_train.cli import main
from moe_train.generate import chat_prompt, generate_ids, load_checkpoint_model
from moe_train.train import train
from training import CODE_TEXT, small_config_data

transformers = pytest.importorskip("transformers")

PROMPT = "What is 2+2?"
FAMILIES = {
    # name: (specials, eos_token, template, template in tokenizer_config.json, bos, end of turn)
    "qwen": (QWEN_SPECIALS, "<|im_end|>", QWEN_TEMPLATE, False, None, "<|im_end|>"),
    "llama": (
        LLAMA_SPECIALS,
        "<|end_of_text|>",
        LLAMA_TEMPLATE,
        True,
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
}


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-tokenizers")
    return {
        name: _tokenizer_dir(root / name, specials, eos, template, in_config, bos=bos)
        for name, (specials, eos, template, in_config, bos, _) in FAMILIES.items()
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_prompt_ids_equal_transformers_apply_chat_template(family, tokenizer_dirs, tmp_path):
    directory = tokenizer_dirs[family]
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    for prompt in (PROMPT, "  Name a colour.\n", "Thanks"):
        ids, end_of_turn = chat_prompt(HFTokenizer(directory), prompt, tmp_path)
        messages = [{"role": "user", "content": prompt}]
        encoded = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        want = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        assert ids == list(want), (prompt, hf.convert_ids_to_tokens(ids))
        assert end_of_turn == hf.convert_tokens_to_ids(FAMILIES[family][-1])


def _chat_checkpoint(tmp_path, directory):
    rows = tmp_path / "chat.jsonl"
    rows.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS * 8))
    prepare_conversations([rows], tmp_path / "data", str(directory))
    data = small_config_data(
        tmp_path / "run",
        tmp_path / "unused.npy",
        model={"vocab_size": 512},
        data={"paths": [str(tmp_path / "data")], "seq_len": 64, "label_mask": True},
        train={"max_steps": 2},
    )
    return train(config_from_dict(data)).checkpoint


def test_chat_generation_stops_at_the_end_of_turn_token(tokenizer_dirs, tmp_path, capsys, monkeypatch):  # fmt: skip
    directory = tokenizer_dirs["qwen"]
    ckpt = _chat_checkpoint(tmp_path, directory)
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    end_of_turn, eos = hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")  # fmt: skip
    messages = [{"role": "user", "content": PROMPT}]
    encoded = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    # A model that draws the end of turn where it drew its third token: its head row for
    # <|im_end|> a little larger than that token's. Generation runs on this model.
    model, config, path = load_checkpoint_model(ckpt, "cpu")
    unforced = generate_ids(model, torch.tensor([prompt_ids]), 40)[0].tolist()
    third = unforced[2]
    with torch.no_grad():
        model.head.weight[end_of_turn] = model.head.weight[third] * 1.001
    free = generate_ids(model, torch.tensor([prompt_ids]), 40)[0].tolist()
    assert end_of_turn in free and eos not in free, free
    monkeypatch.setattr("moe_train.generate.load_checkpoint_model", lambda *_: (model, config, path))  # fmt: skip

    capsys.readouterr()
    args = ["generate", str(ckpt), "--chat", "--prompt", PROMPT, "--max-new-tokens", "40"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == prompt_ids
    expected = free[: free.index(end_of_turn) + 1]
    assert out["ids"] == expected and out["stop_reason"] == "end_of_turn", (out, free)
    assert out["text"] == hf.decode(expected, skip_special_tokens=True)

    # Several stop ids: the first drawn of any of them ends generation.
    stopped = generate_ids(model, torch.tensor([prompt_ids]), 40, eos_id=[10**6, free[1]])
    assert stopped[0].tolist() == free[: free.index(free[1]) + 1]

    # The export names both end tokens, so transformers' own `generate`, given no end token
    # by its caller, stops at the end of turn: here forced as the third new token.
    exported = tmp_path / "hf"
    assert main(["export", str(ckpt), "--out", str(exported)]) == 0
    assert json.loads((exported / "config.json").read_text())["eos_token_id"] == eos
    generation = json.loads((exported / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [eos, end_of_turn], generation
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(exported))
    encoded = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded) == prompt_ids
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32)  # fmt: skip

    def end_turn_third(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] == len(prompt_ids) + 2:
            scores = torch.full_like(scores, float("-inf"))
            scores[:, end_of_turn] = 0.0
        return scores

    with torch.no_grad():
        theirs = hf_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=40,
            logits_processor=transformers.LogitsProcessorList([end_turn_third]),
        )[0, len(prompt_ids) :].tolist()
    assert theirs == [*unforced[:2], end_of_turn], (theirs, unforced)


def test_a_model_without_a_chat_template_is_refused(tmp_path, capsys):
    # A tokenizer.json alone: no template beside it.
    ckpt = str(bpe_text_checkpoint(tmp_path, CODE_TEXT * 100, max_steps=1))
    chat = ["generate", ckpt, "--chat"]
    no_template = f"{tmp_path} has no chat template"
    assert_refused_in_one_line([*chat, "--prompt", "hi"], no_template, capsys)
    prompt_as_text = "--chat takes the prompt as text"
    assert_refused_in_one_line([*chat, "--prompt-ids", "1,2"], prompt_as_text, capsys)


def test_a_run_without_a_known_tokenizer_is_refused(tmp_path, capsys, token_file):
    data = small_config_data(tmp_path / "run", token_file, train={"max_steps": 1})
    ckpt = str(train(config_from_dict(data)).checkpoint)
    assert_refused_in_one_line(
        ["generate", ckpt, "--chat", "--prompt", "hi"], "which is not known here", capsys
    )
