"""Downstream tasks: task files checked, lm-eval's metrics, bits per byte by hand, the same
log-likelihoods on every layout as a float64 reference, and training untouched."""

import json
import math
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from harness.ranks import run_distributed
from moe_data.prepare import prepare_data
from moe_data.tokenizer import ByteTokenizer
from moe_plan.config import config_from_dict
from moe_train.cli import main
from moe_train.cli import run as cli_run
from moe_train.errors import ConfigError, DataError
from moe_train.generate import load_checkpoint_model
from moe_train.task_eval import evaluate_checkpoint
from moe_train.tasks import (
    ChoiceRow,
    MultipleChoiceTask,
    choice_metrics,
    choice_predictions,
    choice_requests,
    read_task,
    text_requests,
)
from moe_train.train import read_metrics, train
from training import CODE_TEXT, CONFIGS, small_config_data

STEPS = 4
SEQ_LEN = 32

QUESTIONS = [
    {"context": "def add(a, b):\n    return", "choices": [" a + b", " x", " Point"], "gold": 0},
    {"context": "class Point:\n    x: int", "choices": [" = 0", " + b", "(a, b)"], "gold": 0},
    {"context": "", "choices": ["def", "zzz"], "gold": 0},  # an empty context
    {"context": "def add(a, b): ", "choices": ["return", "class"], "gold": 1},  # trailing space
    # longer than SEQ_LEN + 1 tokens: the row keeps its last ones
    {"context": "x = 1\n" * 12 + "class", "choices": [" Point:", " Pointé"], "gold": 0},
]
HELD_OUT = "def mul(a, b):\n    return a * b\n\nclass Pointé:\n    y: int = 1\n" * 2


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    corpus = root / "corpus.txt"
    corpus.write_text(CODE_TEXT * 300)
    prepare_data([corpus], root / "data")
    questions = root / "code_mc.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS * 3))
    text = root / "held_out.txt"
    text.write_text(HELD_OUT)
    return root, questions, text


def _data(root, tasks, run, interval=2):
    return small_config_data(
        root / run,
        root / "data",
        model={"vocab_size": 260},  # bytes and end-of-document
        data={"micro_batch_size": 2, "seq_len": SEQ_LEN},
        train={"max_steps": STEPS},
        eval={"tasks": [str(t) for t in tasks], "interval": interval},
        checkpoint={"dir": str(root / run / "checkpoints"), "interval": STEPS},
    )


@pytest.fixture(scope="module")
def trained(files):
    """A run with the tasks in the loop, and the same run without them."""
    root, questions, text = files
    with_tasks = train(config_from_dict(_data(root, [questions, text], "with")))
    without = train(config_from_dict(_data(root, [], "without", interval=0)))
    return with_tasks, without


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ('{"choices": ["a"], "gold": 0}', 'row 2: missing "context"'),
        (
            '{"context": "a", "gold": 0}',
            'row 2: missing "choices"; a row is {"context": str, "choices": [str, ...], '
            '"gold": int} (or {"text": str} in a text task)',
        ),
        ('{"context": "a", "choices": ["b"]}', 'row 2: missing "gold"'),
        ('{"context": "a", "choices": ["b", "c"], "gold": 2}', r'row 2: "gold"=2 must be an'),
        ('{"context": "a", "choices": [], "gold": 0}', 'row 2: "choices" must be a non-empty'),
        ('{"context": "a", "choices": ["b", ""], "gold": 0}', "row 2: choice 1 must be"),
        ('{"context": "a", "choices": ["b"], "gold": true}', 'row 2: "gold"=True'),
        ('{"context": "a", "choices": ["b"]', "row 2: not JSON"),
        ('{"text": "plain"}', "row 2: a text row in a multiple-choice task file"),
    ],
)
def test_a_bad_task_file_is_named_with_its_row(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(QUESTIONS[0]) + "\n" + row + "\n")
    with pytest.raises(DataError, match=rf"^{path}") as error:
        read_task(path)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_eval_tasks_must_be_task_files(tmp_path, token_file):
    data = small_config_data(tmp_path, token_file, eval={"tasks": ["a.csv"], "interval": 1})
    with pytest.raises(ConfigError, match=r"eval\.tasks holds 'a\.csv'; a task file ends in"):
        config_from_dict(data)
    data = small_config_data(tmp_path, token_file, eval={"tasks": ["x/a.txt", "y/a.jsonl"]})
    with pytest.raises(ConfigError, match="both named 'a'"):
        config_from_dict(data)


def test_acc_and_acc_norm_are_lm_evals():
    task = MultipleChoiceTask(
        "t",
        None,
        (
            ChoiceRow("", ("a", "bbbbbb"), 1),  # acc: 'a' (-2 > -3); acc_norm: -3/6 > -2/1
            ChoiceRow("", ("x", "y"), 0),  # a tie goes to the first choice
            ChoiceRow("", ("p", "q"), 1),
        ),
    )
    metrics = choice_metrics(task, [-2.0, -3.0, -1.0, -1.0, -4.0, -0.5])
    assert metrics == {"acc": 2 / 3, "acc_norm": 1.0}


def _reference_loglikelihoods(model, requests):
    """Float64, one request at a time: the sum of its scored targets' log-probabilities."""
    model = model.double()
    out = []
    with torch.no_grad():
        for request in requests:
            tokens = torch.tensor([request.tokens])
            logprobs = torch.log_softmax(model(tokens[:, :-1]).double(), dim=-1)[0]
            picked = logprobs.gather(1, tokens[0, 1:, None])[:, 0]
            out.append(picked[len(picked) - request.scored :].sum().item())
    return out


def _close(name, got, expected, tol=1e-5):
    assert len(got) == len(expected), name
    worst = max(range(len(got)), key=lambda i: abs(got[i] - expected[i]))
    error = abs(got[worst] - expected[worst])
    assert error <= tol * max(1.0, abs(expected[worst])), (
        f"{name}: request {worst}: {got[worst]} vs {expected[worst]}"
    )
    print(f"{name}: {len(got)} requests, worst difference {error:.1e} (request {worst})")


def test_bits_per_byte_is_the_hand_computation(files, trained):
    _, _, text = files
    model, _, _ = load_checkpoint_model(trained[0].run_dir / "checkpoints")
    model = model.double()
    tokens = [256, *HELD_OUT.encode()]  # end-of-document, then the bytes
    assert len(tokens) > 3 * SEQ_LEN  # several windows
    nats = 0.0
    with torch.no_grad():
        for target in range(1, len(tokens)):  # every byte, seen after up to SEQ_LEN tokens
            window = (target - 1) // SEQ_LEN
            last = min(window * SEQ_LEN + 1 + SEQ_LEN, len(tokens))
            inputs = torch.tensor([tokens[max(0, last - SEQ_LEN - 1) : last - 1]])
            position = target - max(0, last - SEQ_LEN - 1) - 1
            logprobs = torch.log_softmax(model(inputs)[0, position].double(), dim=-1)
            nats -= logprobs[tokens[target]].item()
    expected = nats / math.log(2) / len(HELD_OUT.encode("utf-8"))
    _, (result,) = evaluate_checkpoint(trained[0].run_dir / "checkpoints", [text])
    got = result.metrics["bits_per_byte"]
    print(
        f"bits per byte: scorer {got:.9f}, by hand (float64) {expected:.9f}, relative "
        f"difference {abs(got - expected) / expected:.1e} over {len(tokens) - 1} bytes"
    )
    assert abs(got - expected) <= 1e-5 * expected


def _layout_scores(rank, world_size, checkpoint, tasks, layouts):
    """Body for `run_distributed`: each task's log-likelihoods, per layout."""
    return {
        name: [r.loglikelihoods for r in evaluate_checkpoint(checkpoint, tasks, layout=flags)[1]]
        for name, flags in layouts.items()
    }


LAYOUTS = {
    "dp2": [],
    "ep2": ["--parallel.ep=2", "--parallel.dispatcher=all_to_all"],
    "pp2": ["--parallel.pp=2"],
    "cp2": ["--parallel.cp=2"],
}


@pytest.mark.slow
def test_log_likelihoods_are_the_reference_on_every_layout(files, trained):
    _, questions, text = files
    checkpoint = trained[0].run_dir / "checkpoints"
    model, _, _ = load_checkpoint_model(checkpoint)
    tokenizer = ByteTokenizer()
    mc, held_out = read_task(questions), read_task(text)
    expected = [
        _reference_loglikelihoods(model, choice_requests(mc, tokenizer, SEQ_LEN)),
        _reference_loglikelihoods(model, text_requests(held_out, tokenizer, SEQ_LEN)),
    ]
    _, one = evaluate_checkpoint(checkpoint, [questions, text])
    for task, result, reference in zip(("mc", "text"), one, expected, strict=True):
        _close(f"1 process {task}", result.loglikelihoods, reference)
    assert one[0].metrics == choice_metrics(mc, expected[0])
    per_rank = run_distributed(
        _layout_scores, 2, args=(checkpoint, [questions, text], LAYOUTS), timeout=300
    )
    for name in LAYOUTS:
        for rank in (0, 1):
            for task, got, reference in zip(
                ("mc", "text"), per_rank[rank][name], expected, strict=True
            ):
                _close(f"{name} rank {rank} {task}", got, reference)
        assert choice_metrics(mc, per_rank[0][name][0]) == one[0].metrics, name


TIMED = {"tokens_per_s", "mfu", "step_time_s", "data_wait_s", "time", "peak_mem_bytes"}
"""Metrics keys that measure time or memory, which differ from run to run."""


def test_tasks_in_the_loop_leave_training_unchanged(files, trained):
    with_tasks, without = trained
    assert with_tasks.losses == without.losses  # bitwise
    rows = {r["step"]: r for r in read_metrics(with_tasks.run_dir / "metrics.jsonl")}
    for plain in read_metrics(without.run_dir / "metrics.jsonl"):  # routing figures too
        same = {k: v for k, v in rows[plain["step"]].items() if k in plain and k not in TIMED}
        assert same == {k: v for k, v in plain.items() if k not in TIMED}, plain["step"]
    evaluated = [s for s, r in rows.items() if "eval/code_mc/acc" in r]
    assert evaluated == [2, 4]
    last = rows[STEPS]
    assert set(last) >= {
        "eval/code_mc/acc",
        "eval/code_mc/acc_norm",
        "eval/held_out/bits_per_byte",
        "eval/tasks_s",
    }
    _, offline = evaluate_checkpoint(with_tasks.run_dir / "checkpoints", [files[1], files[2]])
    assert last["eval/code_mc/acc"] == offline[0].metrics["acc"]
    assert last["eval/code_mc/acc_norm"] == offline[0].metrics["acc_norm"]
    assert abs(last["eval/held_out/bits_per_byte"] - offline[1].metrics["bits_per_byte"]) < 1e-6


def test_eval_command_prints_json_and_refuses_bad_files(files, trained, capsys, tmp_path):
    _, questions, text = files
    checkpoint = str(trained[0].run_dir / "checkpoints")
    assert cli_run(["eval", checkpoint, "--tasks", str(questions), str(text), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in printed["tasks"]] == ["code_mc", "held_out"]
    assert set(printed["tasks"][0]) >= {"acc", "acc_norm"}
    assert "bits_per_byte" in printed["tasks"][1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": ["b"], "gold": 3}\n')
    assert main(["eval", checkpoint, "--tasks", str(bad)]) == 2
    assert capsys.readouterr().err == (
        f'error: {bad} row 1: "gold"=3 must be an index into "choices" (0 to 0)\n'
    )


AGREEMENT_TASK = """task: moe_stack_agreement
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""
LINES = ["def add(a, b):", "    return a + b", "class Point:", "    x: int = 0", "x = 1", "pass"]


def _agreement_rows(count: int) -> list[dict]:
    """Short questions (all within SEQ_LEN + 1 bytes, so neither side truncates) whose
    contexts end in a newline (which lm-eval moves into the continuation)."""
    rng = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(count):
        pick = torch.randperm(len(LINES), generator=rng).tolist()
        context = LINES[pick[0]][:12] + "\n"
        choices = [LINES[i][:16] for i in pick[1:5]]
        rows.append({"context": context, "choices": choices, "gold": pick[5] % 4})
    return rows


@pytest.mark.slow
def test_lm_eval_on_the_export_makes_our_choices(files, trained, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from moe_train.hf import export_checkpoint

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    checkpoint = trained[0].run_dir / "checkpoints"
    export_checkpoint(checkpoint, tmp_path / "hf")
    data = tmp_path / "agreement.jsonl"
    rows = _agreement_rows(120)
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "agreement.yaml").write_text(AGREEMENT_TASK.format(data=data))

    _, (ours,) = evaluate_checkpoint(checkpoint, [data])
    theirs = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={tmp_path / 'hf'},dtype=float32,max_length={SEQ_LEN}",
        tasks=["moe_stack_agreement"],
        # Our task alone: indexing lm-eval's thousands of task files takes most of the time.
        task_manager=TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False),
        batch_size=64,
        device="cpu",
        log_samples=True,
    )
    samples = sorted(theirs["samples"]["moe_stack_agreement"], key=lambda s: s["doc_id"])
    their_lls = [float(resp[0]) for s in samples for resp in s["filtered_resps"]]
    _close("lm-eval", their_lls, ours.loglikelihoods, tol=1e-4)
    task = read_task(data)
    assert choice_predictions(task, their_lls) == choice_predictions(task, ours.loglikelihoods)
    metrics = theirs["results"]["moe_stack_agreement"]
    (raw, norm), (our_raw, our_norm) = (
        choice_predictions(task, their_lls),
        choice_predictions(task, ours.loglikelihoods),
    )
    agreed = sum(a == b for a, b in zip(raw, our_raw, strict=True))
    agreed_norm = sum(a == b for a, b in zip(norm, our_norm, strict=True))
    worst = max(abs(a - b) for a, b in zip(their_lls, ours.loglikelihoods, strict=True))
    print(
        f"lm-eval agreement: {len(rows)} rows ({len(their_lls)} choices scored), the same "
        f"choice on {agreed}/{len(rows)} (by acc_norm {agreed_norm}/{len(rows)}); acc "
        f"{metrics['acc,none']:.4f} (ours "
        f"{ours.metrics['acc']:.4f}), acc_norm {metrics['acc_norm,none']:.4f} (ours "
        f"{ours.metrics['acc_norm']:.4f}); worst log-likelihood difference {worst:.1e}"
    )
    assert metrics["acc,none"] == ours.metrics["acc"]
    assert metrics["acc_norm,none"] == ours.metrics["acc_norm"]


def test_task_figures_reach_console_and_plots(trained):
    from moe_train.plot import read_runs
    from moe_train.plot.training import TASK_METRICS, tasks_figure
    from moe_train.train.console import task_figures

    line = task_figures(
        {
            "eval/code_mc/acc": 0.5,
            "eval/code_mc/acc_norm": 0.25,
            "eval/held_out/bits_per_byte": 2.125,
            "eval/tasks_s": 0.3,
        }
    )
    assert line == "code_mc acc 0.500 acc_norm 0.250, held_out bpb 2.125"
    figure = tasks_figure(read_runs([trained[0].run_dir]))
    titles = [axes.get_title() for axes in figure.axes]
    assert titles == [f"Tasks: {title}" for title in TASK_METRICS.values()]
    assert [len(axes.lines) for axes in figure.axes] == [1, 1, 1]  # one task each
    assert tasks_figure(read_runs([trained[1].run_dir])) is None  # no tasks, no tasks.png


def test_code_order_asks_for_the_real_order_of_held_out_code(tmp_path):
    from moe_data.builtin import stdlib_source_files
    from moe_train.tasks.builtin import (
        CHOICES,
        CONTEXT_CHARS,
        SPAN_CHARS,
        code_order_rows,
        held_out_files,
    )

    held_out = held_out_files()
    assert held_out and not set(held_out) & set(stdlib_source_files())  # none trained on
    torch_dir = Path(torch.__file__).parent
    assert all(path.is_relative_to(torch_dir) for path in held_out)  # what every install has
    sources = {}
    for i in range(3):
        path = tmp_path / f"module_{i}.py"
        sources[path] = "".join(
            f"    value_{i}_{j} = compute({j}, {j * j}) + other[{i}]\n" for j in range(30)
        )
        path.write_text(sources[path])
    latin = "    name = 'caf\u00e9 cr\u00e8me br\u00fbl\u00e9e', compute(1, 2) + other\n" * 40
    (tmp_path / "latin.py").write_text(latin)  # not ASCII (a byte is not a character): unused
    files = sorted(tmp_path.iterdir())
    rows = code_order_rows(files, questions=40, seed=3)
    assert rows == code_order_rows(files, questions=40, seed=3)  # the same every time
    assert rows != code_order_rows(files, questions=40, seed=4)
    for row in rows:
        choices, gold = row["choices"], row["gold"]
        assert len(choices) == CHOICES and len(set(choices)) == CHOICES
        assert 0 <= gold < CHOICES
        assert len(row["context"]) == CONTEXT_CHARS
        assert SPAN_CHARS[0] <= len(choices[gold]) <= SPAN_CHARS[1]
        # the gold follows the context in one of the files; each distractor is the same
        # characters (so the same length) in another order
        assert any(row["context"] + choices[gold] in text for text in sources.values())
        assert all(sorted(choice) == sorted(choices[gold]) for choice in choices)
        assert not any(
            row["context"] + c in t for c in choices if c != choices[gold] for t in sources.values()
        )
    assert len({row["gold"] for row in rows}) == CHOICES  # the answer moves around


def test_builtin_code_order_is_made_once_from_the_held_out_files(tmp_path):
    from moe_train.errors import DataError
    from moe_train.tasks import BUILTIN_TASKS, builtin_task_file, open_task
    from moe_train.tasks.builtin import QUESTIONS, code_order_rows, held_out_files

    assert BUILTIN_TASKS == ("builtin:code_order",)
    path = builtin_task_file("builtin:code_order", tmp_path)
    task = open_task("builtin:code_order", tmp_path)  # read and checked as any task file
    assert task.name == "code_order" and len(task.rows) == QUESTIONS
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == code_order_rows(held_out_files())
    with pytest.raises(DataError, match=r"builtin:next_line: no such built-in task"):
        builtin_task_file("builtin:next_line", tmp_path)


def test_code_order_is_remade_when_the_torch_source_changes(tmp_path, monkeypatch):
    from moe_train.tasks import builtin

    fake_torch = tmp_path / "torch"
    module = fake_torch / "nn" / "modules" / "linear.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "".join(f"    self.weight_{j} = Parameter(torch.empty({j}))\n" for j in range(80))
    )
    (fake_torch / "nn" / "__pycache__").mkdir()
    (fake_torch / "nn" / "__pycache__" / "stale.py").write_text("x = 1\n" * 50)
    (fake_torch / "_inductor").mkdir()
    (fake_torch / "_inductor" / "other.py").write_text("y = 2\n" * 50)
    monkeypatch.setattr(builtin, "_torch_dir", lambda: fake_torch)
    assert builtin.held_out_files() == [module]  # the named subpackages only
    first = builtin.builtin_task_file("builtin:code_order", tmp_path / "cache")
    assert builtin.builtin_task_file("builtin:code_order", tmp_path / "cache") == first
    module.write_text(module.read_text().replace("Parameter", "Buffer"))  # same file name
    second = builtin.builtin_task_file("builtin:code_order", tmp_path / "cache")
    assert second != first and "Buffer" in second.read_text()
    module.unlink()
    with pytest.raises(DataError, match=r"has no Python source under nn, optim, "):
        builtin.held_out_files()


# Runs the quickstart (configs/tiny.yaml) for one step, scoring its task, in a Python whose
# standard library holds only what builtin:stdlib trains on (as Debian's python3 without its
# separate test-suite and IDLE packages).
_WITHOUT_TEST_SUITE = """
import sys, sysconfig
stdlib, argv = sys.argv[1], sys.argv[2:]
real = sysconfig.get_paths
sysconfig.get_paths = lambda *a, **k: {**real(*a, **k), "stdlib": stdlib}
from moe_train.cli import main
sys.exit(main(argv))
"""


@pytest.mark.slow
def test_the_quickstart_task_needs_no_test_suite(tmp_path):
    from moe_data.builtin import builtin_dataset_dir, stdlib_source_files

    real = Path(sysconfig.get_paths()["stdlib"])
    stdlib = tmp_path / "stdlib"  # only the files builtin:stdlib trains on
    for path in stdlib_source_files():
        (stdlib / path.relative_to(real)).parent.mkdir(parents=True, exist_ok=True)
        (stdlib / path.relative_to(real)).symlink_to(path)
    assert not (stdlib / "test").exists() and not (stdlib / "idlelib").exists()
    cache = tmp_path / "cache"  # the training data as prepared (the same file listing)
    cache.mkdir()
    prepared = builtin_dataset_dir()
    (cache / prepared.name).symlink_to(prepared)
    run = tmp_path / "run"
    quickstart = ["train", str(CONFIGS / "tiny.yaml"), "--train.max_steps=1", "--eval.interval=1"]
    quickstart += [f"--train.run_dir={run}", f"--data.cache_dir={cache}"]
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TEST_SUITE, str(stdlib), *quickstart],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in cache.iterdir()) == [prepared.name, "tasks"]  # no new data
    scored = [row for row in read_metrics(run / "metrics.jsonl") if "eval/code_order/acc" in row]
    assert [row["step"] for row in scored] == [1]
    assert 0 <= scored[0]["eval/code_order/acc"] <= 1
