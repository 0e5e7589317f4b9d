"""Settings for every test process.

One intra-op thread: the tests' matrices are small, so their matmuls are bound by the threads'
start and hand-over rather than by arithmetic, and on a machine whose cores are all busy an
OpenMP thread that waits for a core stalls every op of the other. The environment variable is
set before torch is imported, so that it also holds in every process a test starts (torchrun
and its workers, `moe-train` subprocesses, gloo ranks), as they already ran.

Compiled bytecode is cached, even where the environment says not to (PYTHONDONTWRITEBYTECODE,
as some containers set): the suite starts many Python processes (torchrun and its workers,
gloo ranks, `moe-train` commands), and each would otherwise compile torch's sources anew,
seconds of a core each.

`COLUMNS` is unset, so the console prints whole lines as it does into a file (tests that check
wrapping set it themselves).
"""

import os
import sys

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
os.environ.pop("COLUMNS", None)  # console lines whole, as in a log file, unless a test sets it
sys.dont_write_bytecode = False

import torch  # noqa: E402  (after the settings above)

torch.set_num_threads(1)

from harness.ranks import keep_rank_processes  # noqa: E402  (after the thread settings)

# Gloo ranks of `run_distributed` stay alive between tests: each test pays its work, not the
# seconds of imports of a new process per rank.
keep_rank_processes()

LONGEST_FIRST = (
    "moe_train/test_checkpointing.py",
    "moe_train/test_planned_layouts.py",
    "moe_train/test_distributed_training.py",
    "moe_train/test_training_choices.py",
    "moe_train/test_expert_parallel_gradients.py",
    "benchmarks/test_vs_fsdp.py",
    "moe_train/test_muon_training.py",
    "moe_train/test_preemption.py",
    "moe_train/test_lost_ranks.py",
    "moe_dispatch/test_symmetric_memory.py",
    "moe_train/test_pipeline_training.py",
    "moe_train/test_routing_distributed.py",
    "moe_train/test_tasks.py",
)
"""The test files that take longest (summed durations of a full run), longest first."""


def pytest_collection_modifyitems(config, items):
    """The longest files first: the workers (`-n auto --dist loadfile`) take files in this
    order, so no long file starts when the others are done and one worker runs on alone."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def order(item) -> int:
        path = item.path.relative_to(config.rootpath / "tests").as_posix()
        return rank.get(path, len(rank))

    items.sort(key=order)  # stable: the other files, and the tests of each, keep their order
