"""docs/fine-tuning.md runs as written: its script builds a tiny random Qwen3-MoE with a chat
template, and its commands import it, prepare conversations, fine-tune with configs/sft-tiny.yaml
(evaluating), score it with `moe-train eval`, export, and chat; the export chats alike in
transformers."""

import json
from pathlib import Path

import pytest
import torch

from doc_commands import doc_commands, shell_blocks
from moe_train.cli import main
from moe_train.train import read_metrics

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "fine-tuning.md"
PROMPT = "What is 3+4?"


def _script() -> str:
    """The page's Python script (its first python block)."""
    blocks = [lines for info, _, lines in shell_blocks(PAGE.read_text()) if info == "python"]
    return "\n".join(blocks[0])


def _walkthrough() -> list[tuple[str, ...]]:
    """The page's moe-train commands of the walkthrough (not the upcycling examples)."""
    commands = [c.words for c in doc_commands(ROOT, [PAGE]) if c.words[0] == "moe-train"]
    return [words for words in commands if words[1] != "upcycle"]


@pytest.mark.slow
def test_the_fine_tuning_walkthrough_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    exec(compile(_script(), "make_tiny_chat_moe.py", "exec"), {"__name__": "__main__"})
    commands = _walkthrough()
    assert [words[1] for words in commands] == [
        "import-hf", "prepare-data", "prepare-data", "train", "eval", "export", "generate",
    ]  # fmt: skip
    outputs = []
    for words in commands:
        capsys.readouterr()
        code = main(list(words[1:]))
        out, err = capsys.readouterr()
        assert code == 0, f"`{' '.join(words)}` exited {code}:\n{err[-3000:]}"
        outputs.append(out)
        with capsys.disabled():
            print(f"\n$ {' '.join(words)}\n{out.strip()}")

    rows = read_metrics(tmp_path / "runs/sft-tiny/metrics.jsonl")
    losses = [row["loss"] for row in rows]
    evals = [row["eval_loss"] for row in rows if row.get("eval_loss") is not None]
    with capsys.disabled():
        print(f"train loss {losses[0]:.4f} -> {losses[-1]:.4f}; eval_loss {evals}")
    assert len(evals) == 2 and evals[-1] < losses[0] - 1.0, (evals, losses)
    assert losses[-1] < losses[0] - 1.0, losses
    assert all(0 < row["trained_tokens"] < 16 * 128 for row in rows)

    # The multiple-choice sums (four choices): above chance (0.25) by over two standard
    # deviations of a guesser's accuracy on 64 questions (0.054).
    scored = json.loads(outputs[4])
    (task,) = scored["tasks"]
    assert task["name"] == "sums", task
    assert task["acc"] > 0.375, task

    # The chat: the template's prompt ids, stopped at the end-of-turn token.
    chat = ["generate", "runs/sft-tiny/checkpoints", "--chat", "--prompt", PROMPT, "--json"]
    assert main(chat) == 0
    ours = json.loads(capsys.readouterr().out)
    assert ours["text"] == outputs[-1].strip()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained("exported/sft-tiny")
    messages = [{"role": "user", "content": PROMPT}]
    encoded = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt_ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    assert ours["prompt_ids"] == prompt_ids
    end_of_turn = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ours["stop_reason"] == "end_of_turn" and ours["ids"][-1] == end_of_turn, ours

    # The export generates the same tokens in transformers, stopping at <|im_end|>: its
    # generation_config.json names it beside <|endoftext|>, so no caller needs to.
    generation = json.loads(Path("exported/sft-tiny/generation_config.json").read_text())
    end_of_text = hf_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert generation["eos_token_id"] == [end_of_text, end_of_turn], generation
    model = transformers.AutoModelForCausalLM.from_pretrained("exported/sft-tiny", dtype=torch.float32)  # fmt: skip
    with torch.no_grad():
        theirs = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=64,
        )[0, len(prompt_ids) :].tolist()
    assert theirs == ours["ids"], (theirs, ours["ids"])
