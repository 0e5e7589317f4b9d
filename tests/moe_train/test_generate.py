"""`moe-train generate`: KV-cached decoding equals the full forward; checkpoints of any layout
generate the same tokens; sampling is seeded and top-k bounded; errors are one line."""

import json
from pathlib import Path

import pytest
import torch
from generate_checks import assert_refused_in_one_line, bpe_text_checkpoint

from harness.ranks import run_distributed
from moe_checkpoint import read_trainer_state
from moe_data import prepare_data
from moe_data.tokenizer import ByteTokenizer
from moe_plan.config import config_from_dict
from moe_train.cli import main
from moe_train.generate import generate, generate_ids, next_token
from moe_train.model import Transformer
from moe_train.train import train
from training import CODE_TEXT, save_byte_tokens, small_config_data, small_model_config

TEXT = CODE_TEXT * 100


def _assert_close(ours: torch.Tensor, reference: torch.Tensor, atol: float, what: str) -> None:
    difference = (ours - reference).abs()
    worst = tuple(int(i) for i in torch.unravel_index(difference.argmax(), ours.shape))
    assert difference.max() <= atol, (
        f"{what}: worst at {worst}: cached {ours[worst]:.7g}, full forward {reference[worst]:.7g}"
    )


def _cached_logits(model: Transformer, tokens_BS: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Logits of `tokens_BS` run through a KV cache in chunks of the given lengths."""
    cache = model.new_kv_cache(tokens_BS.shape[0], tokens_BS.shape[1])
    logits, start = [], 0
    for length in chunks:
        logits.append(model(tokens_BS[:, start : start + length], cache))
        start += length
    assert start == tokens_BS.shape[1] == cache.length
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_cached_decoding_gives_the_full_forward_logits_at_every_position(qk_norm):
    config = small_model_config(n_layers=3)
    config.qk_norm = qk_norm
    model = Transformer(config, seed=3).eval()
    tokens_BS = torch.randint(
        0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(7)
    )
    with torch.no_grad():
        full = model(tokens_BS)
        # A prompt, a chunk continuing it (masked attention to the cache), then one at a time.
        cached = _cached_logits(model, tokens_BS, [6, 4] + [1] * 14)
    _assert_close(cached, full, 1e-5, f"qk_norm={qk_norm}")


def test_rotary_tables_grown_in_steps_equal_tables_made_at_once():
    """A model that ran 8 positions, then decodes to 20 (its rotary tables grown twice), gives
    the logits of a fresh model run on all 20 positions at once."""
    config = small_model_config()
    grown = Transformer(config, seed=1).eval()
    fresh = Transformer(config, seed=1).eval()
    tokens_BS = torch.randint(
        0, config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        grown(tokens_BS[:, :8])
        assert grown.rope_cos.shape[0] == 8
        cached = _cached_logits(grown, tokens_BS, [5] + [1] * 15)
        full = fresh(tokens_BS)
    assert grown.rope_cos.shape[0] == fresh.rope_cos.shape[0] == 20
    _assert_close(cached, full, 1e-5, "grown rotary tables")


def test_cached_greedy_tokens_equal_a_plain_greedy_loop():
    config = small_model_config()
    model = Transformer(config, seed=5).eval()
    prompt_BS = torch.randint(
        0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(4)
    )
    tokens = prompt_BS
    with torch.no_grad():
        for _ in range(20):  # the whole sequence again at every step
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    cached = generate_ids(model, prompt_BS, 20)
    uncached = generate_ids(model, prompt_BS, 20, use_cache=False)
    assert torch.equal(cached, tokens[:, 7:]), (cached, tokens[:, 7:])
    assert torch.equal(uncached, cached)
    first_B = cached[:, 0]
    stopped = generate_ids(model, prompt_BS[:1], 20, eos_id=int(first_B[0]))
    assert stopped.tolist() == [[int(first_B[0])]]


def test_sampling_is_seeded_and_stays_within_the_top_k():
    logits_BV = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    top3 = set(logits_BV[0].topk(3).indices.tolist())

    def draws(seed: int, top_k: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [int(next_token(logits_BV, 2.0, top_k, generator)) for _ in range(300)]

    assert draws(1, 3) == draws(1, 3)
    assert set(draws(1, 3)) == top3
    assert len(set(draws(1, 0))) > 3
    assert set(draws(2, 1)) == {int(logits_BV.argmax())}


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory) -> Path:
    """Checkpoints root of 3 steps on text prepared with the byte tokenizer (eos 256)."""
    root = tmp_path_factory.mktemp("byte_run")
    (root / "train.txt").write_text(TEXT)
    prepare_data([root / "train.txt"], root / "data", tokenizer="byte")
    data = small_config_data(
        root / "run",
        root / "unused.npy",
        model={"vocab_size": 260},
        data={"paths": [str(root / "data")], "seq_len": 16},
        train={"max_steps": 3},
    )
    result = train(config_from_dict(data))
    return result.checkpoint.parent


def _save(rank: int, world_size: int, data: dict) -> None:
    train(config_from_dict(data))


@pytest.fixture(scope="module")
def id_runs(tmp_path_factory) -> dict[str, Path]:
    """Checkpoints of one run on pre-tokenized ids (no tokenizer known), saved by one process
    and by two expert-parallel ranks."""
    root = tmp_path_factory.mktemp("id_runs")
    token_file = save_byte_tokens(root / "tokens.npy", TEXT)
    runs = {}
    for name, parallel in {"single": {}, "ep2": {"ep": 2, "dispatcher": "all_to_all"}}.items():
        data = small_config_data(root / name, token_file, train={"max_steps": 3}, parallel=parallel)
        if parallel:
            run_distributed(_save, world_size=2, args=(data,))
        else:
            train(config_from_dict(data))
        runs[name] = root / name / "checkpoints" / "step_00000003"
    assert read_trainer_state(runs["ep2"])["config"]["parallel"]["ep"] == 2
    return runs


def test_a_checkpoint_saved_at_ep2_generates_the_single_process_tokens(id_runs):
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 5, "seed": 3}):
        single, ep2 = (
            generate(id_runs[name], prompt_ids="100,101,102", max_new_tokens=12, **sampling)
            for name in ("single", "ep2")
        )
        assert len(single.ids) == 12 and single.text is None and single.stop_reason == "length"
        assert ep2.ids == single.ids, (sampling, ep2.ids, single.ids)


def test_generation_uses_the_trained_weights(id_runs):
    """A checkpoints root resolves to its newest checkpoint, whose weights give the tokens."""
    from moe_train.generate import load_checkpoint_model

    model, config, ckpt = load_checkpoint_model(id_runs["single"].parent, "cpu")
    assert ckpt == id_runs["single"]
    fresh = Transformer(config.model, seed=config.train.seed)
    assert not torch.equal(fresh.embed.weight, model.embed.weight)
    prompt = torch.tensor([[100, 101, 102]])
    expected = generate_ids(model, prompt, 8, use_cache=False)[0].tolist()
    assert (
        generate(id_runs["single"].parent, prompt_ids=[100, 101, 102], max_new_tokens=8).ids
        == expected
    )


def test_json_gives_prompt_ids_new_ids_and_text(byte_run, capsys):
    assert (
        main(["generate", str(byte_run), "--prompt", "def ", "--max-new-tokens", "10", "--json"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == list(b"def ")
    assert 1 <= len(out["ids"]) <= 10 and all(0 <= i < 260 for i in out["ids"])
    assert out["text"] == ByteTokenizer().decode(out["ids"])
    assert out["stop_reason"] == ("eos" if out["ids"][-1] == 256 else "length")


def test_plain_output_is_the_decoded_continuation(byte_run, capsys):
    args = ["generate", str(byte_run), "--prompt", "class ", "--max-new-tokens", "6"]
    assert main([*args, "--json"]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    assert main(args) == 0
    assert capsys.readouterr().out == text + "\n"


def test_seed_repeats_a_sampled_run_and_top_k_1_is_greedy(byte_run, capsys):
    def ids(*extra: str) -> list[int]:
        args = ["generate", str(byte_run), "--prompt-ids", "100,101,102", "--json"]
        assert main([*args, "--max-new-tokens", "16", *extra]) == 0
        return json.loads(capsys.readouterr().out)["ids"]

    sampled = ids("--temperature", "1.5", "--seed", "4")
    assert ids("--temperature", "1.5", "--seed", "4") == sampled
    assert ids("--temperature", "1.5", "--top-k", "1", "--seed", "9") == ids()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--prompt", "hello"], "--prompt-ids"),
        (["--prompt-ids", "1,x,3"], "comma-separated"),
        (["--prompt-ids", "1,9999"], "model.vocab_size"),
        (["--prompt-ids", "1", "--top-k", "-1"], "--top-k=-1"),
    ],
)
def test_bad_input_is_one_error_line(id_runs, args, expected, capsys):
    assert_refused_in_one_line(["generate", str(id_runs["single"]), *args], expected, capsys)


def test_a_tokenizer_json_of_the_data_encodes_the_prompt_and_decodes_the_text(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    ckpt = bpe_text_checkpoint(tmp_path, TEXT, max_steps=2)
    tokenizer = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    capsys.readouterr()
    assert main(["generate", str(ckpt), "--prompt", "class Point", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == tokenizer.encode("class Point", add_special_tokens=False).ids
    assert out["text"] == tokenizer.decode(out["ids"], skip_special_tokens=True)
