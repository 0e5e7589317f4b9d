"""How long the planner's page waits for an answer: each shipped config through the server's
own request handler.

For every `configs/*.yaml` two requests are timed: the page's default one (8 H100 GPUs, 8 per
node, a budget of 1e12 tokens) and, for a config whose header names a device count in its
`# Planner:` or `# Calibration:` line, that count and device. Each time is one call of
`Planner.plan` (a fresh planner, so no answer is cached: the request's fields turned into
`moe-train plan` words, parsed, planned, made JSON-ready) plus the `json.dumps` the handler
sends, the median over `--repeats` interleaved rounds, as wall-clock seconds and as this
process's CPU seconds (on a loaded shared machine the wall time waits for the cores; the CPU
time is close to what an idle machine's wall time would be: the planner is single-threaded). "layouts" counts the rows evaluated
(fitting and rejected); "answer MB" is the size of the body the page receives. A request that
fits nowhere is answered 422 with the plan, as the page gets it: timed the same way.

    uv run python benchmarks/plan_speed.py     # bench_results/plan_speed.json

The machines are shared and noisy: the load average is written with the figures."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

from harness.output import print_table, write_json
from moe_train.cli.plan import plan_words_of
from moe_train.plan.serve import BadRequest, Planner, shipped_configs

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PAGE_DEFAULT = {"gpu": "h100", "gpus": "8", "gpus_per_node": "8", "tokens": "1e12"}
"""The device fields the page starts with."""
HEADER = re.compile(r"^# (?:Planner|Calibration):.*?(\d+) x (\w+)|--gpus (\d+) --gpu (\w+)", re.M)


def requests_of(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """The page's default request for the config, and its header's device count if any."""
    out = [("page default", {"config": path.name, **PAGE_DEFAULT})]
    match = HEADER.search(path.read_text())
    if match is not None:
        gpus, gpu = (match[1], match[2]) if match[1] else (match[3], match[4])
        fields = {**PAGE_DEFAULT, "gpus": gpus, "gpu": gpu}
        out.append((f"{gpus} {gpu}", {"config": path.name, **fields}))
    return out


def answer_once(
    configs: dict[str, Path], request: dict[str, Any]
) -> tuple[float, float, int, dict]:
    """Wall and CPU seconds of one uncached answer (planning and the JSON body), its status
    and body."""
    start, cpu = time.perf_counter(), time.process_time()
    try:
        body, status = Planner(plan_words_of, configs).plan(request), 200
    except BadRequest as e:
        body, status = {"errors": e.errors, **(e.plan or {})}, int(e.status)
    text = json.dumps(body)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return seconds, cpu, status, {"body": body, "bytes": len(text)}


def run(names: list[str] | None, repeats: int) -> list[dict[str, Any]]:
    configs = shipped_configs(None, CONFIGS)
    cases = [
        (name, label, request)
        for name, path in configs.items()
        if names is None or name in names
        for label, request in requests_of(path)
    ]
    seconds: dict[int, list[float]] = {i: [] for i in range(len(cases))}
    cpu: dict[int, list[float]] = {i: [] for i in range(len(cases))}
    seen: dict[int, tuple[int, dict]] = {}
    for _ in range(repeats):
        for i, (_, _, request) in enumerate(cases):
            took, used, status, answer = answer_once(configs, request)
            seconds[i].append(took)
            cpu[i].append(used)
            seen[i] = (status, answer)
    rows = []
    for i, (name, label, _) in enumerate(cases):
        status, answer = seen[i]
        plan = answer["body"].get("plan", answer["body"])
        rows.append(
            {
                "config": name,
                "request": label,
                "status": status,
                "layouts": len(plan.get("fitting", [])) + len(plan.get("rejected", [])),
                "answer_bytes": answer["bytes"],
                "seconds": statistics.median(seconds[i]),
                "all_seconds": seconds[i],
                "cpu_seconds": statistics.median(cpu[i]),
                "all_cpu_seconds": cpu[i],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=None, help="file names (default: all)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--out", type=Path, default=Path("bench_results/plan_speed.json"))
    args = parser.parse_args()
    rows = run(args.configs, args.repeats)
    print_table(
        ("config", "request", "status", "layouts", "answer MB", "seconds", "CPU s"),
        (
            [
                r["config"],
                r["request"],
                r["status"],
                f"{r['layouts']:,}",
                f"{r['answer_bytes'] / 1e6:.2f}",
                f"{r['seconds']:.2f}",
                f"{r['cpu_seconds']:.2f}",
            ]
            for r in rows
        ),
        left=("request",),
    )
    config = {"repeats": args.repeats, "cores": len(os.sched_getaffinity(0))}
    config["load_average"] = os.getloadavg()
    write_json(args.out, {"config": config, "results": rows})


if __name__ == "__main__":
    main()
