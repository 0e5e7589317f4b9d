"""prepare-data throughput: MB/s of JSON Lines per worker count, byte and BPE tokenizers.

Generates a corpus (``--mb`` MB of JSON Lines in 8 files, random words with some non-ASCII)
and a byte-level BPE tokenizer (``--vocab`` ids, trained with the ``tokenizers`` library on a
slice of it), then times ``prepare_data`` for each tokenizer and worker count, interleaved
over ``--repeats`` rounds (the machines are shared and noisy: compare ratios, not lone
figures). Each time is the whole call: planning, starting the workers, tokenizing, hashing the
inputs and shards, and the manifest. Every process runs the tokenizer on one thread (the
workers do so themselves; this process sets TOKENIZERS_PARALLELISM=false for the one-worker
runs), so N workers use N cores. MB/s is input bytes over seconds, the median over rounds;
"vs 1 worker" divides by the one-worker figure of the same tokenizer. Every run's token
stream is checked equal to the one-worker run's.

Two references are measured in the same rounds: the start-up cost (the same call on a tiny
corpus of one file per worker, so that as many workers start; "MB/s net" leaves it out), and
the parallelism the machine gives right now (a pure-Python loop in N spawned processes
against the same work in one: ideally N)."""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before the tokenizers library is loaded

from harness.output import print_table, write_json
from harness.timing import medians
from moe_data import prepare_data

_WORD_LIST = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their model data token "
    "expert router layer train loss naïve café Straße ελληνικά 日本語 данные 1984 3.14 , . ; ( )"
)
_WORDS = _WORD_LIST.split()


def write_corpus(root: Path, megabytes: float, seed: int) -> int:
    """`megabytes` of JSON Lines in 8 files under `root`; the bytes written."""
    rng = random.Random(seed)
    target = int(megabytes * 1e6) // 8
    total = 0
    for index in range(8):
        lines = []
        size = 0
        while size < target:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(20, 400))]
            line = json.dumps({"id": f"{index}-{len(lines)}", "text": " ".join(words)}) + "\n"
            lines.append(line)
            size += len(line.encode())
        (root / f"part-{index}.jsonl").write_text("".join(lines), encoding="utf-8")
        total += size
    return total


def train_tokenizer(root: Path, vocab_size: int) -> Path:
    """A byte-level BPE tokenizer.json with <|endoftext|>, trained on the first corpus file."""
    import tokenizers

    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sample = (root / "part-0.jsonl").read_text(encoding="utf-8")[:2_000_000]
    tokenizer.train_from_iterator(
        [json.loads(line)["text"] for line in sample.splitlines()[:-1]], trainer
    )
    path = root.parent / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def stream_digest(out_dir: Path) -> str:
    """sha256 of the token stream: the shards in the manifest's order."""
    meta = json.loads((out_dir / "meta.json").read_text())
    digest = hashlib.sha256()
    for shard in meta["shards"]:
        digest.update((out_dir / shard["file"]).read_bytes())
    return digest.hexdigest()


def _burn(count: int) -> int:
    total = 0
    for i in range(count):
        total += i * i
    return total


def control_speedup(processes: int, count: int = 4_000_000) -> float:
    """How much faster `processes` spawned processes do `processes` units of pure-Python
    work than one process does them in turn (started processes; ideally `processes`)."""
    start = time.perf_counter()
    for _ in range(processes):
        _burn(count)
    serial = time.perf_counter() - start
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        pool.map(_burn, [1] * processes)
        start = time.perf_counter()
        pool.map(_burn, [count] * processes, chunksize=1)
        parallel = time.perf_counter() - start
    return serial / parallel


def write_tiny_corpus(root: Path, files: int) -> None:
    """`files` files of one 64 KiB shard each, so that with --shard-size 64K as many workers
    start, each with almost nothing to do."""
    root.mkdir()
    line = json.dumps({"text": "a small document " * 20}) + "\n"
    for index in range(files):
        (root / f"tiny-{index}.jsonl").write_text(line * ((64 << 10) // len(line) + 1))


def run(args: argparse.Namespace, work: Path) -> tuple[list[dict], dict[int, float]]:
    corpus = work / "corpus"
    corpus.mkdir()
    input_bytes = write_corpus(corpus, args.mb, args.seed)
    tokenizers = {"byte": "byte", "bpe": str(train_tokenizer(corpus, args.vocab))}
    for workers in args.workers:
        write_tiny_corpus(work / f"tiny-{workers}", workers)
    cases = [(name, workers) for name in args.tokenizers for workers in args.workers]
    seconds: dict[tuple[str, int], list[float]] = {case: [] for case in cases}
    startup: dict[tuple[str, int], list[float]] = {case: [] for case in cases}
    control: dict[int, list[float]] = {w: [] for w in args.workers if w > 1}
    digests: dict[tuple[str, int], str] = {}
    tokens: dict[str, int] = {}
    for round_index in range(args.repeats):
        for workers in control:
            control[workers].append(control_speedup(workers))
        for name, workers in cases:
            out = work / f"out-{name}-{workers}-{round_index}"
            start = time.perf_counter()
            prepare_data([work / f"tiny-{workers}"], out, tokenizers[name], workers=workers,
                         shard_size="64K")  # fmt: skip
            startup[(name, workers)].append(time.perf_counter() - start)
            shutil.rmtree(out)
            start = time.perf_counter()
            meta = prepare_data([corpus], out, tokenizers[name], workers=workers)
            seconds[(name, workers)].append(time.perf_counter() - start)
            tokens[name] = meta["num_tokens"]
            digests.setdefault((name, workers), stream_digest(out))
            shutil.rmtree(out)
    rows = []
    for name, workers in cases:
        if digests[(name, workers)] != digests[(name, args.workers[0])]:
            raise SystemExit(f"{name}: {workers} workers wrote another token stream")
        median = statistics.median(seconds[(name, workers)])
        base = statistics.median(seconds[(name, args.workers[0])])
        fixed = statistics.median(startup[(name, workers)])
        base_net = base - statistics.median(startup[(name, args.workers[0])])
        rows.append(
            {
                "tokenizer": name,
                "workers": workers,
                "input_mb": input_bytes / 1e6,
                "tokens": tokens[name],
                "seconds": median,
                "startup_seconds": fixed,
                "mb_per_s": input_bytes / 1e6 / median,
                "mb_per_s_net": input_bytes / 1e6 / (median - fixed),
                "vs_first": base / median,
                "vs_first_net": base_net / (median - fixed),
                "all_seconds": seconds[(name, workers)],
                "all_startup_seconds": startup[(name, workers)],
            }
        )
    return rows, medians(control)


def print_summary(rows: list[dict], control: dict[int, float], first_workers: int) -> None:
    header = ("tokenizer", "workers", "input MB", "tokens", "seconds", "start-up s", "MB/s")
    header += ("MB/s net", f"vs {first_workers} worker", "vs 1, net")
    print_table(
        header,
        (
            [
                row["tokenizer"],
                row["workers"],
                f"{row['input_mb']:.1f}",
                f"{row['tokens']:,}",
                f"{row['seconds']:.2f}",
                f"{row['startup_seconds']:.2f}",
                f"{row['mb_per_s']:.1f}",
                f"{row['mb_per_s_net']:.1f}",
                f"{row['vs_first']:.2f}",
                f"{row['vs_first_net']:.2f}",
            ]
            for row in rows
        ),
    )
    for workers, speedup in control.items():
        print(
            f"machine now: {workers} processes of pure-Python work ran {speedup:.2f}x as fast "
            f"as one (ideal {workers:.2f}x)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=32.0, help="corpus size (MB of JSON Lines)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokenizers", nargs="+", default=["byte", "bpe"], choices=["byte", "bpe"])
    parser.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench_results/prepare_data.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="prepare-data-bench-") as work:
        rows, control = run(args, Path(work))
    print_summary(rows, control, args.workers[0])
    config = {key: value for key, value in vars(args).items() if key != "out"}
    config["cores"] = len(os.sched_getaffinity(0))
    config["load_average"] = os.getloadavg()
    result = {"config": config, "results": rows, "control_speedup": control}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
