"""Settings for every test process.

One intra-op thread: the tests' matrices are small, so their matmuls are bound by the threads'
start and hand-over rather than by arithmetic, and on a machine whose cores are all busy an
OpenMP thread that waits for a core stalls every op of the other. The environment variable is
set before torch is imported, so that it also holds in every process a test starts (torchrun
and its workers, `moe-train` subprocesses, gloo ranks), as they already ran.
"""

import os

os.environ["OMP_NUM_THREADS"] = "1"

import torch

torch.set_num_threads(1)

from harness.ranks import keep_rank_processes  # noqa: E402  (after the thread settings)

# Gloo ranks of `run_distributed` stay alive between tests: each test pays its work, not the
# seconds of imports of a new process per rank.
keep_rank_processes()
