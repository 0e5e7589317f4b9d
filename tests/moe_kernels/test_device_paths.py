"""The kernels ask moe-devices' rule about the device they run on: on a CPU everything FP8 is
emulated, and where a kernel falls back on a GPU from what was asked, one warning says why."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from moe_devices import Software, kernel_paths
from moe_kernels import (
    device_kernel_paths,
    device_paths,
    fp8_rowwise_scaled_mm_supported,
    installed_software,
    mxfp8,
)


def test_on_a_cpu_the_fp8_kernels_are_emulated_and_the_grouped_gemm_is_torch():
    paths = device_kernel_paths("cpu")
    assert paths == kernel_paths(None, installed_software())
    assert paths.device == "cpu"
    assert (paths.mxfp8.name, paths.fp8_rowwise.name, paths.fp8_linear.name) == ("emulated",) * 3
    assert paths.grouped_mm.name == "torch"
    assert paths.expert_gemm.name == "grouped_mm"
    assert fp8_rowwise_scaled_mm_supported(torch.zeros(2, dtype=torch.bfloat16)) == (
        "the device is a CPU"
    )


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device of a chosen capability, everything installed, no warning given yet."""

    def on(capability: tuple[int, int]) -> SimpleNamespace:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        return SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16)

    monkeypatch.setattr(device_paths, "installed_software", lambda: Software())
    monkeypatch.setattr(device_paths, "_warned", set())
    return on


def test_a_gpu_takes_the_rules_paths_for_its_capability(gpu):
    x = gpu((9, 0))
    assert device_kernel_paths(x.device) == kernel_paths((9, 0))
    assert fp8_rowwise_scaled_mm_supported(x) is None
    assert fp8_rowwise_scaled_mm_supported(SimpleNamespace(device=x.device, dtype=torch.float32))
    x = gpu((8, 0))
    assert fp8_rowwise_scaled_mm_supported(x) == kernel_paths((8, 0)).fp8_rowwise.reason


def test_a_fallback_on_a_gpu_warns_once_saying_why(gpu):
    x = gpu((9, 0))
    with pytest.warns(RuntimeWarning) as caught:
        assert mxfp8._use_torchao("auto", x) is False
    (warning,) = caught
    assert str(warning.message) == (
        "mxfp8_grouped_mm runs emulated on cuda:0: the GPU is sm_90; torchao's MXFP8 needs sm_100"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mxfp8._use_torchao("auto", x) is False, "warned a second time"
        assert mxfp8._use_torchao("emulated", x) is False


def test_no_warning_on_a_cpu(monkeypatch):
    monkeypatch.setattr(device_paths, "_warned", set())
    x = torch.zeros(2, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mxfp8._use_torchao("auto", x) is False
