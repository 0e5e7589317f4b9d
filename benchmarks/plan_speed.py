"""How long the planner's page waits for an answer: each shipped config through the server's
own request handler, beside the whole `moe-plan --json` of the same inputs.

For every `configs/*.yaml` two requests are timed: the page's default one (8 H100 GPUs, 8 per
node, a budget of 1e12 tokens) and, for a config whose header names a device count in its
`# Planner:` or `# Calibration:` line, that count and device. "page" is one call of
`Planner.plan` (a fresh planner, so no answer is cached: the request's fields turned into
`moe-plan` words, parsed, planned, the shown rows made JSON-ready; the planner's caches
of memory pieces emptied first) plus the `json.dumps`
the handler sends; "--json" is `plan_json_of` of the same words plus `json.dumps`: every
layout's full figures, which is what the page received before its answer carried only the rows
it shows (and what it cost: the rejected layouts' traffic and step time, and their rows). Each
is the median over `--repeats` interleaved rounds, as this process's CPU seconds and as
wall-clock seconds (on a loaded shared machine the wall time waits for the cores; the CPU
time is close to what an idle machine's wall time would be: the planner is single-threaded).
"layouts" counts the layouts evaluated, "fit" those that fit. A request that fits nowhere is
answered 422 with the plan, as the page gets it: timed the same way.

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
from moe_plan.cli import plan_json_of, plan_words_of
from moe_plan.memory import clear_caches
from moe_plan.serve import DEVICE_DEFAULTS, BadRequest, Planner, shipped_configs

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PAGE_DEFAULT = DEVICE_DEFAULTS
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


def answer_once(configs: dict[str, Path], request: dict[str, Any]) -> dict[str, Any]:
    """Wall and CPU seconds of one uncached page answer (planning and the JSON body), its
    status, body and size."""
    clear_caches()
    start, cpu = time.perf_counter(), time.process_time()
    try:
        body, status = Planner(plan_words_of, configs).plan(request), 200
    except BadRequest as e:
        body, status = {"errors": e.errors, **(e.plan or {})}, int(e.status)
    size = len(json.dumps(body))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"seconds": seconds, "cpu": cpu, "status": status, "body": body, "bytes": size}


def full_once(argv: list[str]) -> dict[str, Any]:
    """Wall and CPU seconds of `plan --json`'s whole answer for the same words, and its size
    (uncached too)."""
    clear_caches()
    start, cpu = time.perf_counter(), time.process_time()
    size = len(json.dumps(plan_json_of(argv, search=False)))
    return {
        "seconds": time.perf_counter() - start,
        "cpu": time.process_time() - cpu,
        "bytes": size,
    }


def run(names: list[str] | None, repeats: int) -> list[dict[str, Any]]:
    configs = shipped_configs(None, CONFIGS)
    cases = [
        (name, label, request)
        for name, path in configs.items()
        if names is None or name in names
        for label, request in requests_of(path)
    ]
    answer_once(configs, cases[0][2])  # imports and first-use caches, as a served page has
    page: dict[int, list[dict]] = {i: [] for i in range(len(cases))}
    full: dict[int, list[dict]] = {i: [] for i in range(len(cases))}
    for _ in range(repeats):
        for i, (_, _, request) in enumerate(cases):
            page[i].append(answer_once(configs, request))
            argv = page[i][-1]["body"]["argv"][1:-1]  # the words of the command shown
            full[i].append(full_once(argv))
    rows = []
    for i, (name, label, _) in enumerate(cases):
        last = page[i][-1]
        plan = last["body"]["plan"]
        rows.append(
            {
                "config": name,
                "request": label,
                "status": last["status"],
                "layouts": plan["fitting_count"] + plan["rejected_count"],
                "fitting": plan["fitting_count"],
                "answer_bytes": last["bytes"],
                "full_bytes": full[i][-1]["bytes"],
                **_medians("", page[i]),
                **_medians("full_", full[i]),
            }
        )
    return rows


def _medians(prefix: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    seconds, cpu = [r["seconds"] for r in runs], [r["cpu"] for r in runs]
    return {
        f"{prefix}seconds": statistics.median(seconds),
        f"{prefix}all_seconds": seconds,
        f"{prefix}cpu_seconds": statistics.median(cpu),
        f"{prefix}all_cpu_seconds": cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=None, help="file names (default: all)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--out", type=Path, default=Path("bench_results/plan_speed.json"))
    args = parser.parse_args()
    rows = run(args.configs, args.repeats)
    print_table(
        (
            "config",
            "request",
            "status",
            "layouts",
            "fit",
            "page KB",
            "page CPU s",
            "page s",
            "--json MB",
            "--json CPU s",
            "--json s",
            "CPU x",
        ),
        (
            [
                r["config"],
                r["request"],
                r["status"],
                f"{r['layouts']:,}",
                f"{r['fitting']:,}",
                f"{r['answer_bytes'] / 1e3:,.0f}",
                f"{r['cpu_seconds']:.2f}",
                f"{r['seconds']:.2f}",
                f"{r['full_bytes'] / 1e6:.2f}",
                f"{r['full_cpu_seconds']:.2f}",
                f"{r['full_seconds']:.2f}",
                f"{r['full_cpu_seconds'] / r['cpu_seconds']:.1f}",
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
