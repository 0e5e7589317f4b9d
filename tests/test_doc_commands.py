"""The commands of the README and of docs/ run as written.

Every command in a shell block (bash, sh, shell, console) of README.md and docs/**/*.md that
starts with `uv run` or `moe-train` has an entry in COMMANDS, keyed by its words without the
`uv run`: Run (this test runs it) or Skip (not run here, and why). A command on a page that has
no entry fails, and so does an entry whose command is on no page.

The Run commands run in order in one process, through `moe_train.cli.main`, in a scratch
directory that holds what the pages assume (`configs/`, a small corpus and `tokenizer.json`
in the form docs/data.md builds, a run with checkpoints at steps 3 and 6), after replacing
the words of PLACEHOLDERS; a training command gets SHORT's words appended (the last override
wins), so that it stops after two steps.
"""

import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from doc_commands import DocCommand, doc_commands
from moe_train.cli import main
from tokenizer_files import bpe_tokenizer_file
from training import CODE_TEXT

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = "COMMANDS in tests/test_doc_commands.py"


@dataclass(frozen=True)
class Run:
    """Run by this test, as written, with `extra` words appended; `paths` replaces words of
    PLACEHOLDERS for this command alone."""

    extra: tuple[str, ...] = ()
    paths: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Skip:
    """Not run by this test: why not, and what covers it instead."""

    reason: str


SHORT = Run(("--train.max_steps=2",))
TESTS_RUN_BY_CI = "the test suite, this test among them; .ci/run runs it"
TWO_PROCESSES = (
    "2 processes under torchrun; tests/moe_train/test_distributed_training.py runs `torchrun "
    "-m moe_train.cli train` on 2 processes and trains tiny.yaml at ep=2 against one process"
)

LAUNCH_OPTION = (
    "2 processes started by --nproc-per-node; tests/moe_train/test_launch_option.py starts 2 "
    "ranks through the option and checks its refusals in-process"
)

INVARIANCE = (
    "trains each cell and its single process in fresh processes, minutes each on 2 cores; "
    "tests/benchmarks/test_invariance.py checks --list, the comparison, the card and "
    "--spread, and trains the CI subset"
)
WALKTHROUGH = (
    "the fine-tuning walkthrough, on the tiny model its script builds; "
    "tests/moe_train/test_sft_walkthrough.py runs the page's script and commands in order"
)
UPCYCLE = (
    "needs a downloaded dense model; tests/moe_train/test_upcycle.py upcycles tiny Qwen3 and "
    "Llama models built with transformers"
)

COMMANDS: dict[str, Run | Skip] = {
    # README.md, docs/index.md, docs/quickstart.md
    "moe-train --help": Run(),
    "moe-train train configs/tiny.yaml": SHORT,
    "moe-train train configs/tiny.yaml --optim.lr=1e-3 --model.moe.top_k=1 --train.max_steps=50": (
        SHORT
    ),
    "moe-train train configs/tiny.yaml --nproc-per-node 2 --parallel.ep=2": Skip(
        f"{LAUNCH_OPTION}; tests/moe_train/test_distributed_training.py trains tiny.yaml at ep=2 "
        "on 2 ranks against one process"
    ),
    "torchrun --nproc-per-node 2 -m moe_train.cli train configs/tiny.yaml --parallel.ep=2": Skip(
        TWO_PROCESSES
    ),
    "moe-train prepare-data chats.jsonl --format chat --tokenizer path/to/hf-model --out data/chat": (
        Skip(
            "needs a chat model's tokenizer directory; tests/moe_train/test_chat_data.py runs "
            "the command on ones built locally"
        )
    ),
    "moe-train train config.yaml --data.paths=[data/chat] --data.label_mask=true "
    "--data.document_masking=true": Skip(
        "trains on the prepared conversations above; tests/moe_train/test_label_mask.py trains "
        "with a label mask and document masking"
    ),
    "pytest": Skip(TESTS_RUN_BY_CI),
    "pytest -m not slow": Skip(TESTS_RUN_BY_CI),
    "ruff check": Skip("the linter; .ci/run runs it"),
    "ruff format": Skip("rewrites the sources; .ci/run runs `ruff format --check`"),
    "python scripts/gen_reference.py": Skip(
        "rewrites docs/reference/; tests/test_reference_docs.py runs it with --check"
    ),
    "mkdocs serve": Skip(
        "a server that runs until stopped; .ci/run builds the same site with --strict"
    ),
    # docs/checkpoints.md, docs/routing.md: the quickstart's run
    "moe-train inspect runs/tiny/checkpoints": Run(),
    "moe-train inspect runs/tiny/checkpoints/step_00000200 --json --no-verify": Run(),
    "moe-train plot runs/tiny": Run(),
    "moe-train plot runs/tiny runs/tiny.1 --out plots": Run(),
    # docs/data.md
    "python - <<EOF": Skip(
        "builds a corpus of the whole standard library and trains a tokenizer on it (minutes); "
        "the scratch directory holds a small corpus and tokenizer.json of the same form"
    ),
    "moe-train prepare-data corpus --out data/stdlib --tokenizer tokenizer.json": Run(),
    "moe-train train configs/tiny.yaml --data.paths=[data/stdlib] --model.vocab_size=4096 "
    "--train.run_dir=runs/stdlib-bpe": SHORT,
    "moe-train prepare-data corpus/part-0.jsonl.gz corpus/part-1.jsonl.gz corpus/part-2.jsonl.gz "
    "--out data/parts-012 --tokenizer tokenizer.json": Run(),
    "moe-train prepare-data corpus/part-3.jsonl.gz --out data/part-3 --tokenizer tokenizer.json": (
        Run()
    ),
    "moe-train train configs/tiny.yaml --model.vocab_size=4096 --train.run_dir=runs/stdlib-mix "
    "--data.mixture=[{name: main, paths: [data/parts-012], weight: 0.5}, "
    "{name: upweighted, paths: [data/part-3], weight: 0.5}]": SHORT,
    # docs/training.md
    "moe-train prepare-data corpus/train.jsonl --out data/train": Run(),
    "moe-train prepare-data corpus/heldout.jsonl --out data/heldout": Run(),
    "moe-train train configs/tiny.yaml --data.paths=[data/train] --eval.paths=[data/heldout] "
    "--eval.interval=100 --eval.batches=4": SHORT,
    "moe-train train configs/tiny.yaml --train.tensorboard=true --train.wandb_project=moe": Skip(
        "logs to W&B, which needs an account or WANDB_MODE=offline; "
        "tests/moe_train/test_tracking.py trains with both trackers (W&B offline)"
    ),
    "tensorboard --logdir runs/tiny/tensorboard": Skip(
        "a server that runs until stopped; tests/moe_train/test_tracking.py reads the events"
    ),
    # docs/parallelism.md, docs/long-runs.md
    "torchrun --nproc-per-node 2 -m moe_train.cli train configs/tiny.yaml": Skip(TWO_PROCESSES),
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 "
    "--rdzv-id my-run -m moe_train.cli train configs/olmoe-1b-7b.yaml": Skip("two nodes of 8 GPUs"),
    "torchrun --nproc-per-node 4 -m moe_train.cli train configs/tiny.yaml --parallel.pp=2 "
    "--parallel.ep=2 --parallel.dispatcher=all_to_all --data.micro_batch_size=4 "
    "--parallel.distributed_optimizer=true --parallel.recompute=selective": Skip(
        "4 processes under torchrun; tests/moe_train/test_pipeline_training.py trains "
        "pp=2 x ep=2 x dp=2 with the distributed optimizer against one process"
    ),
    "moe-train train configs/tiny.yaml --nproc-per-node 2 --parallel.cp=2 "
    "--train.run_dir=runs/tiny-cp2": Skip(
        f"{LAUNCH_OPTION}; tests/moe_train/test_context_parallel_training.py trains cp=2 on 2 "
        "ranks against one process"
    ),
    "torchrun --nproc-per-node 4 -m moe_train.cli train configs/tiny.yaml --parallel.cp=2 "
    "--parallel.ep=2 --data.micro_batch_size=4": Skip(
        "4 processes under torchrun; tests/moe_train/test_context_parallel_training.py trains "
        "cp=2 x ep=2 on 4 ranks against one process"
    ),
    "torchrun --nproc-per-node 8 -m moe_train.cli train configs/olmoe-1b-7b.yaml "
    "--train.run_dir=runs/olmoe --checkpoint.resume=auto": Skip("8 GPUs"),
    # docs/planner.md
    "python scripts/plan_calibration.py": Skip(
        "prints the calibration table; tests/moe_plan/test_plan_calibration.py computes the "
        "same table and checks that docs/planner.md holds it"
    ),
    "moe-train plan configs/olmoe-1b-7b.yaml --gpus 8 --gpu h100": Run(),
    "moe-train plan configs/published-1t-a58b.yaml --gpus 512 --gpu b300 --json > plan.json": (
        Run()
    ),
    "moe-train plan my.yaml --gpus 64 --gpu-memory-gib 94 --gpu-tflops 989 "
    "--intra-node-gbps 450 --inter-node-gbps 50": Run(
        paths={"my.yaml": "configs/olmoe-1b-7b.yaml"}  # one that starts on 64 devices: exit 0
    ),
    "moe-train plan configs/olmoe-1b-7b.yaml --gpus 8 --gpu h100 --top 3 --overrides": Run(),
    "moe-train plan configs/olmoe-1b-7b.yaml --gpus 64 --gpu h100 --tokens 2e12": Run(),
    "moe-train plan --serve --port 8037": Skip(
        "serves until interrupted; tests/moe_plan/test_plan_page.py starts `plan --serve` and "
        "drives the page in Chromium"
    ),
    # docs/audit.md
    "moe-train verify runs/a/checkpoints/step_00000003 runs/a/checkpoints/step_00000006": Run(),
    # docs/verification.md
    "python benchmarks/invariance.py --list": Skip(INVARIANCE),
    "python benchmarks/invariance.py": Skip(INVARIANCE),
    "python benchmarks/invariance.py --features muon,mtp --layouts ep2,pp2": Skip(INVARIANCE),
    "python benchmarks/invariance.py --all --json invariance.json": Skip(INVARIANCE),
    "python benchmarks/invariance.py --card invariance.json": Skip(INVARIANCE),
    "python benchmarks/invariance.py --all --json seed0.json": Skip(INVARIANCE),
    "python benchmarks/invariance.py --features bf16_distopt,fp8_rowwise --seed 1 --json "
    "seed1.json": Skip(INVARIANCE),
    "python benchmarks/invariance.py --features bf16_distopt,fp8_rowwise --seed 2 --json "
    "seed2.json": Skip(INVARIANCE),
    "python benchmarks/invariance.py --spread seed0.json seed1.json seed2.json": Skip(
        "reads the matrices the commands above write; tests/benchmarks/test_invariance.py "
        "runs --spread on matrices of its own"
    ),
    "python benchmarks/invariance.py --all --backend auto --json invariance-nccl.json": Skip(
        "a node of 8 GPUs"
    ),
    # docs/interop.md
    "moe-train export runs/small/checkpoints --out exported/small": Run(),
    "moe-train export runs/small/checkpoints --out exported/v1 --name small-code-v1": Run(),
    "moe-train export runs/small/checkpoints/step_00001000 --out exported/bf16 --dtype bfloat16": (
        Run()
    ),
    "moe-train import-hf ./Qwen3-tiny --out imported": Run(),
    "moe-train train imported/config.yaml --data.paths=[data/my_corpus] --train.run_dir=runs/ft": (
        SHORT
    ),
    "moe-train train my.yaml --checkpoint.init_from=imported": SHORT,
    "moe-train generate runs/my-run/checkpoints --prompt def fibonacci(n): --max-new-tokens 64": (
        Run()
    ),
    "moe-train generate CKPT --prompt-ids 100,101,102 --temperature 0.8 --top-k 40 --seed 1 "
    "--json": Run(),
    # docs/evaluation.md
    "moe-train eval runs/tiny/checkpoints --tasks tasks/code_questions.jsonl tasks/held_out.txt": (
        Skip(
            "the reader's task files; tests/moe_train/test_tasks.py runs moe-train eval on its own"
        )
    ),
    "moe-train eval runs/tiny/checkpoints --tasks builtin:code_order --json": Skip(
        "800 rows of forward; tests/moe_train/test_tasks.py runs moe-train eval --json"
    ),
    "torchrun --nproc-per-node 2 -m moe_train.cli eval runs/tiny/checkpoints "
    "--tasks builtin:code_order --parallel.ep=2": Skip(
        "2 processes; tests/moe_train/test_tasks.py scores a checkpoint on dp2, ep2 and pp2 in "
        "one 2-rank launch"
    ),
    "python scripts/code_order_curve.py runs/tiny-0 runs/tiny-1 runs/tiny-2 "
    "--out docs/code-order-accuracy.png": Skip(
        "needs three 200-step quickstart runs; tests/moe_train/test_tasks.py checks that the "
        "quickstart scores builtin:code_order"
    ),
    "lm_eval --model hf --model_args pretrained=exported/small,dtype=float32,max_length=128 "
    "--tasks agreement --include_path tasks --device cpu": Skip(
        "the reader's lm-eval task; tests/moe_train/test_tasks.py runs lm-eval's Hugging Face "
        "backend on an export through its Python API (a slow test)"
    ),
    # docs/fine-tuning.md
    "python make_tiny_chat_moe.py": Skip(WALKTHROUGH),
    "moe-train import-hf tiny-chat-moe --out imported": Skip(WALKTHROUGH),
    "moe-train prepare-data chats/train.jsonl --format chat --tokenizer tiny-chat-moe "
    "--out data/chat-train": Skip(WALKTHROUGH),
    "moe-train prepare-data chats/heldout.jsonl --format chat --tokenizer tiny-chat-moe "
    "--out data/chat-heldout": Skip(WALKTHROUGH),
    "moe-train train configs/sft-tiny.yaml": Skip(WALKTHROUGH),
    "moe-train eval runs/sft-tiny/checkpoints --tasks chats/sums.jsonl --json": Skip(WALKTHROUGH),
    "moe-train export runs/sft-tiny/checkpoints --out exported/sft-tiny": Skip(WALKTHROUGH),
    "moe-train generate runs/sft-tiny/checkpoints --chat --prompt What is 3+4?": Skip(WALKTHROUGH),
    "moe-train upcycle ./Qwen3-0.6B --experts 8 --top-k 2 --out upcycled": Skip(UPCYCLE),
    "moe-train upcycle ./Qwen3-0.6B --experts 32 --top-k 8 --granularity 4 --noise 0.01 "
    "--out upcycled-fine": Skip(UPCYCLE),
}
"""Every command of the pages, in the order the Run ones run (a later one may read what an
earlier one wrote)."""

PLACEHOLDERS = {
    "runs/small": "runs/tiny",
    "runs/my-run": "runs/tiny",
    "CKPT": "runs/tiny/checkpoints",
    "step_00001000": "step_00000002",
    "step_00000200": "step_00000002",
    "./Qwen3-tiny": "exported/small",
    "data/my_corpus": "data/train",
    "my.yaml": "configs/tiny.yaml",
}
"""Words of the pages that stand for the reader's own paths, and what the scratch directory
has in their place (runs/tiny is the quickstart's run, exported/small its export)."""


BARE_ALLOWED: set[str] = set()
"""Pages allowed `moe-train` commands without `uv run`. None should be: a listed page that has
no such command fails too, so the set only shrinks."""


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _commands_by_key() -> dict[str, list[DocCommand]]:
    found: dict[str, list[DocCommand]] = {}
    for command in doc_commands(ROOT, _pages()):
        found.setdefault(command.key, []).append(command)
    return found


def test_every_command_of_the_pages_is_run_or_skipped_with_a_reason():
    found = _commands_by_key()
    missing = [
        f"{command.where}: `{key}` has no entry in {REGISTRY}; add it as Run() if it runs in "
        "seconds on a CPU (PLACEHOLDERS for paths of the reader's own), else as Skip('why')"
        for key, commands in found.items()
        if key not in COMMANDS
        for command in commands
    ]
    stale = [
        f"{REGISTRY}: `{key}` is on no page of README.md or docs/; remove its entry, or correct "
        "it to the page's command"
        for key in COMMANDS
        if key not in found
    ]
    assert not missing + stale, "\n".join(missing + stale)


def test_moe_train_commands_start_with_uv_run():
    """A bare `moe-train` is found only in an activated virtual environment; `uv run` finds
    it in a clone as it is."""
    bare = [c for c in doc_commands(ROOT, _pages()) if not c.uv_run]
    pages = {c.where.split(":")[0] for c in bare}
    problems = [
        f"{c.where}: `{c.key}` is not found outside an activated venv; write `uv run {c.key}`"
        for c in bare
        if c.where.split(":")[0] not in BARE_ALLOWED
    ]
    problems += [
        f"{page} has no bare moe-train command now: remove it from BARE_ALLOWED"
        for page in sorted(BARE_ALLOWED - pages)
    ]
    assert not problems, "\n".join(problems)


def test_the_registry_is_well_formed():
    runs = [key for key, entry in COMMANDS.items() if isinstance(entry, Run)]
    assert [key for key in runs if not key.startswith("moe-train ")] == [], "Run: moe-train only"
    assert [key for key, entry in COMMANDS.items() if entry == Skip("")] == [], "Skip needs a why"
    unused = [word for word in PLACEHOLDERS if not any(word in key for key in runs)]
    assert unused == [], "PLACEHOLDERS no Run command uses"
    for reason in (entry.reason for entry in COMMANDS.values() if isinstance(entry, Skip)):
        for path in re.findall(r"\btests/\S+\.py\b", reason):
            assert (ROOT / path).is_file(), f"a skip reason names {path}, which does not exist"


def test_the_extraction_reads_blocks_as_a_shell_would(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\n"
        "uv run moe-train train a.yaml \\\n    --x=1  # a comment\n"
        "uv run python - <<'EOF'\nmoe-train not-a-command\nEOF\n"
        "moe-train plan b.yaml --data.mixture='[{a: 1},\n    {b: 2}]'\n"
        "pip install something\n"
        "```\n"
        "```console\n$ uv run moe-train inspect CKPT\nmoe-train output, not a command\n```\n"
        "    ```sh\n    moe-train verify A B\n    ```\n"
        "```text\nuv run moe-train not-a-shell-block\n```\n"
    )
    found = [(c.where, c.key, c.uv_run) for c in doc_commands(tmp_path, [page])]
    assert found == [
        ("page.md:2", "moe-train train a.yaml --x=1", True),
        ("page.md:4", "python - <<EOF", True),
        ("page.md:7", "moe-train plan b.yaml --data.mixture=[{a: 1}, {b: 2}]", False),
        ("page.md:12", "moe-train inspect CKPT", True),
        ("page.md:16", "moe-train verify A B", False),
    ]


def _documents() -> list[str]:
    """Small Python-like modules, each a document."""
    return [f"# module {i}\n{CODE_TEXT * (2 + i % 7)}" for i in range(400)]


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory that holds what the pages' commands assume, made the current one."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # builtin:stdlib goes here
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    documents = _documents()
    (tmp_path / "corpus").mkdir()
    for part in range(4):  # docs/data.md's corpus, smaller
        with gzip.open(tmp_path / f"corpus/part-{part}.jsonl.gz", "wt") as f:
            f.writelines(json.dumps({"text": text}) + "\n" for text in documents[part::4])
    for name, texts in (("train", documents[:300]), ("heldout", documents[300:])):
        lines = (json.dumps({"text": text}) + "\n" for text in texts)
        (tmp_path / f"corpus/{name}.jsonl").write_text("".join(lines))
    bpe_tokenizer_file(tmp_path, "".join(documents))
    # The run docs/audit.md verifies: checkpoints at steps 3 and 6.
    run_a = ["--train.run_dir=runs/a", "--train.max_steps=6", "--checkpoint.interval=3"]
    assert main(["train", "configs/tiny.yaml", "--model.n_layers=1", *run_a]) == 0
    return tmp_path


def _run(command: DocCommand, entry: Run, capsys) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `command` run through the CLI's entry point."""
    words = list(command.words)
    for index, word in enumerate(words):
        for placeholder, value in {**PLACEHOLDERS, **entry.paths}.items():
            word = word.replace(placeholder, value)
        words[index] = word
    out_file = None
    if ">" in words:
        at = words.index(">")
        words, out_file = words[:at], words[at + 1]
    capsys.readouterr()
    try:
        code = main([*words[1:], *entry.extra])
    except SystemExit as stop:  # --help, and argparse's own errors
        code = stop.code
    out, err = capsys.readouterr()
    if out_file is not None:
        Path(out_file).write_text(out)
    return code, out, err


@pytest.mark.slow
def test_the_commands_of_the_pages_run(scratch, capsys):
    found = _commands_by_key()
    for key, entry in COMMANDS.items():
        if isinstance(entry, Run) and key in found:
            command = found[key][0]
            code, _, err = _run(command, entry, capsys)
            assert code == 0, f"{command.where}: `{key}` exited {code}:\n{err[-3000:]}"
    assert (scratch / "runs/tiny/checkpoints/step_00000002").is_dir()
    assert (scratch / "runs/tiny.1/checkpoints/step_00000002").is_dir()
    assert {"config.json", "README.md"} <= {p.name for p in (scratch / "exported/bf16").iterdir()}
    assert (scratch / "imported/config.yaml").is_file()
    rows = [json.loads(line) for line in (scratch / "runs/ft/metrics.jsonl").open()]
    assert [row["step"] for row in rows][-1] == 2
    assert json.loads((scratch / "plan.json").read_text())
    assert (scratch / "runs/tiny/plots/loss.png").is_file()
    assert (scratch / "plots/loss.png").is_file()
