"""moe_kernels tests: without a CUDA device, Triton kernels run under the Triton interpreter.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, so it is set here, before any test
module imports a kernel module.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
