"""prepare-data --format chat / prompt-completion: the template's ids, the assistant mask."""

import json

import numpy as np
import pytest

from moe_data.conversations import prepare_conversations
from moe_data.labels import mask_file_name
from moe_data.token_files import shard_file_name
from moe_train.errors import DataError

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

QWEN_TEMPLATE = (
    "{%- if messages[0].role != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- message.content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

CONVERSATIONS = [
    [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "And 4?"},
        {"role": "assistant", "content": "4"},
    ],
    [
        {"role": "user", "content": "Say hello"},
        {"role": "assistant", "content": "  Hello there!\n"},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue, like the sea and the sky."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Green."},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You are welcome."},
    ],
]


def _with_reasoning(conversation):
    """The conversation with reasoning on its assistant replies, under the names datasets
    use (`thinking`, `reasoning_content`)."""
    replies = 0
    messages = []
    for message in conversation:
        message = dict(message)
        if message["role"] == "assistant":
            replies += 1
            key = "thinking" if replies % 2 else "reasoning_content"
            message[key] = f"Let me think ({replies})."
        messages.append(message)
    return messages


def _tokenizer_dir(directory, specials, eos, template, in_config, bos=None):
    """A tiny byte-level BPE tokenizer directory, its template in tokenizer_config.json (as
    older transformers wrote) or chat_template.jinja (as transformers 5 writes)."""
    directory.mkdir()
    corpus = " ".join(m["content"] for c in CONVERSATIONS for m in c) * 3
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([corpus], trainer=trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}
    if bos is not None:
        config["bos_token"] = bos
    if in_config:
        config["chat_template"] = template
    else:
        (directory / "chat_template.jinja").write_text(template)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "qwen": (
            _tokenizer_dir(root / "qwen", QWEN_SPECIALS, "<|im_end|>", QWEN_TEMPLATE, False),
            "<|endoftext|>",
        ),
        "qwen3": (
            _tokenizer_dir(root / "qwen3", QWEN_SPECIALS, "<|im_end|>", QWEN3_TEMPLATE, False),
            "<|endoftext|>",
        ),
        "llama": (
            _tokenizer_dir(
                root / "llama",
                LLAMA_SPECIALS,
                "<|end_of_text|>",
                LLAMA_TEMPLATE,
                True,
                bos="<|begin_of_text|>",
            ),
            "<|end_of_text|>",  # (tokenizer_config.json's eos_token)
        ),
    }


def _reference_text_and_spans(family, messages):
    """The rendered text built by hand, and the character spans training covers: each
    assistant reply's content (as rendered: trimmed where the template trims it) and its
    end-of-turn token."""
    text, spans = "", []
    if family == "qwen3":  # a reply's span holds its reasoning too
        for m in messages:
            text += f"<|im_start|>{m['role']}\n"
            start = len(text)
            if m["role"] == "assistant":
                reasoning = m.get("reasoning_content") or m.get("thinking")
                text += f"<think>\n{reasoning}\n</think>\n\n" if reasoning else ""
                text += m["content"] + "<|im_end|>"
                spans.append((start, len(text)))
            else:
                text += m["content"] + "<|im_end|>"
            text += "\n"
    elif family == "qwen":
        if messages[0]["role"] != "system":
            text += "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        for m in messages:
            text += f"<|im_start|>{m['role']}\n"
            start = len(text)
            text += m["content"] + "<|im_end|>"
            if m["role"] == "assistant":
                spans.append((start, len(text)))
            text += "\n"
    else:
        text = "<|begin_of_text|>"
        for m in messages:
            text += f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n"
            start = len(text)
            text += m["content"].strip() + "<|eot_id|>"
            if m["role"] == "assistant":
                spans.append((start, len(text)))
    return text, spans


def _documents(out, eos_id):
    meta = json.loads((out / "meta.json").read_text())
    ids = np.fromfile(out / shard_file_name(0), dtype=meta["dtype"]).astype(np.int64)
    mask = np.fromfile(out / mask_file_name(0), dtype=np.uint8)
    ends = np.flatnonzero(ids == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return meta, [(ids[s:e], mask[s:e], mask[e]) for s, e in zip(starts, ends, strict=True)]


@pytest.mark.parametrize("family", ["qwen", "qwen3", "llama"])
def test_chat_ids_equal_transformers_and_mask_covers_assistant_spans(tmp_path, families, family):
    directory, separator = families[family]
    conversations = CONVERSATIONS
    if family == "qwen3":
        conversations = [_with_reasoning(c) for c in CONVERSATIONS]
    rows = tmp_path / "chat.jsonl"
    rows.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    meta = prepare_conversations([rows], tmp_path / "out", str(directory))
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    assert meta["eos_id"] == hf.convert_tokens_to_ids(separator) and meta["label_mask"] is True
    _, documents = _documents(tmp_path / "out", meta["eos_id"])
    assert len(documents) == len(conversations) == meta["num_documents"]
    for messages, (ids, mask, eos_mask) in zip(conversations, documents, strict=True):
        encoded = hf.apply_chat_template(messages, tokenize=True)
        want_ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        assert ids.tolist() == list(want_ids)
        text, spans = _reference_text_and_spans(family, messages)
        assert hf.apply_chat_template(messages, tokenize=False) == text
        # Character level: the characters of the trained tokens are exactly the spans'.
        offsets = hf(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        trained_chars = {
            c for (s, e), m in zip(offsets, mask, strict=True) if m for c in range(s, e)
        }
        span_chars = {c for s, e in spans for c in range(s, e)}
        assert trained_chars == span_chars, [
            text[s:e] for (s, e), m in zip(offsets, mask, strict=True) if m
        ]
        assert eos_mask == 0, "the end-of-document id after a conversation is not trained on"


def test_train_on_all_and_prompt_completion(tmp_path, families):
    directory, _ = families["qwen"]
    rows = tmp_path / "chat.jsonl"
    rows.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    meta = prepare_conversations([rows], tmp_path / "all", str(directory), train_on="all")
    _, [(ids, mask, eos_mask)] = _documents(tmp_path / "all", meta["eos_id"])
    assert mask.all() and eos_mask == 1
    texts = tmp_path / "pc.jsonl"
    texts.write_text(json.dumps({"prompt": "What is 2+2? ", "completion": "It is 4."}) + "\n")
    meta = prepare_conversations(
        [texts], tmp_path / "pc", str(directory), data_format="prompt-completion"
    )
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    _, [(ids, mask, eos_mask)] = _documents(tmp_path / "pc", meta["eos_id"])
    prompt = hf("What is 2+2? ", add_special_tokens=False)["input_ids"]
    assert ids.tolist() == prompt + hf("It is 4.", add_special_tokens=False)["input_ids"]
    assert mask.tolist() == [0] * len(prompt) + [1] * (len(ids) - len(prompt)) and eos_mask == 1
    conversational = tmp_path / "pcm.jsonl"
    prompt_messages, completion = CONVERSATIONS[0][:4], CONVERSATIONS[0][4:]
    conversational.write_text(json.dumps({"prompt": prompt_messages, "completion": completion}))
    meta = prepare_conversations(
        [conversational], tmp_path / "pcm", str(directory), data_format="prompt-completion"
    )
    _, [(ids, mask, eos_mask)] = _documents(tmp_path / "pcm", meta["eos_id"])
    assert hf.decode(ids[mask == 1]) == "4<|im_end|>", "only the completion's reply"
    assert eos_mask == 0


def _parquet(path, rows):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


BAD_ROWS = {
    "no assistant turn": (
        {"messages": [{"role": "user", "content": "hi"}]},
        "line 2: it has no assistant message",
    ),
    "unknown role": (
        {"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "o"}]},
        "line 2: message 0 has role 'wizard'; expected one of system, user, assistant",
    ),
    "no content": (
        {"messages": [{"role": "user"}, {"role": "assistant", "content": "o"}]},
        "line 2: message 0 (user) has no text content",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_rows_name_file_and_row_and_write_nothing(tmp_path, families, case):
    directory, _ = families["qwen"]
    row, message = BAD_ROWS[case]
    rows = tmp_path / "chat.jsonl"
    good = {"messages": CONVERSATIONS[1]}
    rows.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as error:
        prepare_conversations([rows], tmp_path / "out", str(directory))
    assert str(error.value).startswith(f"{rows} {message}"), str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl"], "nothing written"


def test_a_file_without_rows_is_refused_in_one_line_and_an_empty_out_is_kept(
    tmp_path, families, capsys
):
    from moe_train.cli import main

    directory, _ = families["qwen"]
    good = {"chat": tmp_path / "chat.jsonl", "prompt-completion": tmp_path / "pc.jsonl"}
    good["chat"].write_text(json.dumps({"messages": CONVERSATIONS[1]}) + "\n")
    good["prompt-completion"].write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
    out = tmp_path / "out"
    out.mkdir()  # an empty --out is allowed: it stays as it was
    for name, text, data_format, fields in [
        ("empty.jsonl", "", "chat", "messages"),
        ("blank.jsonl", "\n \n\n", "chat", "messages"),
        ("blank-pc.jsonl", "\n", "prompt-completion", "prompt and completion"),
    ]:
        rows = tmp_path / name
        rows.write_text(text)
        expected = (
            f"error: {rows} holds no rows, so nothing in it would be trained on; give rows "
            f"with {fields}"
        )
        for inputs in ([rows], [good[data_format], rows]):
            args = ["prepare-data", *map(str, inputs), "--out", str(out), "--format", data_format]
            assert main([*args, "--tokenizer", str(directory)]) == 2
            err = capsys.readouterr().err
            assert err.splitlines()[-1] == expected, err
            assert len(err.splitlines()) == len(inputs), "a line per file read before it"
            assert list(out.iterdir()) == [] and not (tmp_path / ".out.partial").exists()


def test_parquet_rows_and_a_model_without_a_template(tmp_path, families):
    directory, _ = families["llama"]
    rows = _parquet(tmp_path / "chat.parquet", [{"messages": c} for c in CONVERSATIONS])
    meta = prepare_conversations([rows], tmp_path / "out", str(directory / "tokenizer.json"))
    assert meta["num_documents"] == 3 and meta["chat_template"].endswith("chat_template")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((directory / "tokenizer.json").read_bytes())
    (bare / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    with pytest.raises(DataError, match=f"^{bare} has no chat template"):
        prepare_conversations([rows], tmp_path / "out2", str(bare))
    bad = _parquet(tmp_path / "bad.parquet", [{"messages": CONVERSATIONS[0]}, {"messages": []}])
    with pytest.raises(DataError, match=r"bad.parquet row 1 \(counting from 0\): its messages"):
        prepare_conversations([bad], tmp_path / "out3", str(directory))
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()


def test_cli_prepares_chat_and_trains_on_it_and_refuses_a_bad_row(tmp_path, families, capsys):
    from launch import run_cli
    from moe_train.cli import main
    from moe_train.train import read_metrics
    from moe_train.train.manifest import check_data_files
    from training import CONFIGS

    directory, _ = families["qwen"]
    rows = tmp_path / "chat.jsonl"
    rows.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS * 20))
    out = tmp_path / "chat"
    args = ["prepare-data", str(rows), "--out", str(out), "--format", "chat"]
    assert main([*args, "--tokenizer", str(directory)]) == 0
    assert "60 conversations" in capsys.readouterr().out
    _, documents = _documents(out, json.loads((out / "meta.json").read_text())["eos_id"])
    longest = max(len(ids) + 1 for ids, _, _ in documents)
    seq_len = longest - 2  # the longest conversations do not fit a sequence
    overrides = [
        f"--data.paths=[{out}]",
        "--data.label_mask=true",
        "--data.document_masking=true",
        f"--data.seq_len={seq_len}",
        "--model.vocab_size=512",
        "--model.n_layers=1",
        "--train.max_steps=2",
        "--train.peak_flops=1e11",
        "--eval.interval=0",  # tiny.yaml's task is not what this checks
        f"--train.run_dir={tmp_path / 'run'}",
    ]
    assert main(["train", str(CONFIGS / "tiny.yaml"), *overrides]) == 0
    rows_written = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert 0 < rows_written[-1]["trained_tokens"] < 16 * seq_len
    banner = "".join(capsys.readouterr())
    too_long = sum(len(ids) + 1 > seq_len + 1 for ids, _, _ in documents)
    assert 0 < too_long < len(documents)
    assert (
        f"whole documents packed, trained on the label mask; {too_long} documents longer than "
        "data.seq_len+1 skipped (data.split_long_examples=true cuts them instead)"
    ) in banner, banner
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert [f["file"] for f in manifest["data"][0]["files"]] == [
        shard_file_name(0),
        mask_file_name(0),
    ]
    mask_path = out / mask_file_name(0)
    flipped = bytearray(mask_path.read_bytes())
    flipped[5] ^= 1
    mask_path.write_bytes(bytes(flipped))
    assert [p.split(" ")[0] for p in check_data_files(manifest)] == [str(mask_path)]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n" + "{}\n")
    result = run_cli(
        "prepare-data",
        str(bad),
        "--out",
        str(tmp_path / "nothing"),
        "--format",
        "chat",
        "--tokenizer",
        str(directory),
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"error: {bad} line 2: its messages are not a non-empty list of {{role, content}} objects"
    ]
    assert not (tmp_path / "nothing").exists()
    assert not (tmp_path / ".nothing.partial").exists()


def test_compressed_and_saved_dataset_rows_read_like_json_lines(tmp_path, families):
    import gzip

    directory, _ = families["llama"]
    rows = [{"messages": c} for c in CONVERSATIONS]
    rows[1]["messages"] = [dict(m) for m in rows[1]["messages"]]
    rows[1]["messages"][0]["name"] = "ann"  # tables give every message a name, null here
    text = "".join(json.dumps(r) + "\n" for r in rows)
    inputs = {"jsonl": tmp_path / "chat.jsonl", "gzip": tmp_path / "chat.jsonl.gz"}
    inputs["jsonl"].write_text(text)
    inputs["gzip"].write_bytes(gzip.compress(text.encode()))
    zstandard = pytest.importorskip("zstandard")
    inputs["zstd"] = tmp_path / "chat.jsonl.zst"
    inputs["zstd"].write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    datasets = pytest.importorskip("datasets")
    inputs["saved"] = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(inputs["saved"]))
    results = {}
    for name, path in inputs.items():
        meta = prepare_conversations([path], tmp_path / f"out-{name}", str(directory))
        _, documents = _documents(tmp_path / f"out-{name}", meta["eos_id"])
        results[name] = [(ids.tolist(), mask.tolist()) for ids, mask, _ in documents]
    assert len(results["jsonl"]) == 3
    for name in inputs:
        assert results[name] == results["jsonl"], name
