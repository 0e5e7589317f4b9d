"""moe-devices' rule: which kernels a device of a given capability runs, over a table of
devices and installed software, and that it imports without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moe_devices import Software, kernel_paths

NOTHING = Software(
    cuda=None, torchao=False, torchao_mxfp8_kernels=False, scaled_grouped_mm=False, triton=False
)

# capability, software, (mxfp8, fp8_rowwise, fp8_linear, grouped_mm, expert_gemm)
TABLE = {
    "cpu": (None, Software(), ("emulated", "emulated", "emulated", "torch", "grouped_mm")),
    "sm_80": ((8, 0), Software(), ("emulated", "emulated", "emulated", "measured", "grouped_mm")),
    "sm_89": ((8, 9), Software(), ("emulated", "emulated", "native", "measured", "grouped_mm")),
    "sm_90": ((9, 0), Software(), ("emulated", "scaled_mm", "native", "measured", "fp8_rowwise")),
    "sm_100": ((10, 0), Software(), ("torchao", "emulated", "native", "measured", "mxfp8")),
    "sm_103": ((10, 3), Software(), ("torchao", "emulated", "native", "measured", "mxfp8")),
    "sm_120": ((12, 0), Software(), ("emulated", "emulated", "native", "measured", "grouped_mm")),
    "sm_100_cuda_12.6": (
        (10, 0),
        Software(cuda=(12, 6)),
        ("emulated", "emulated", "native", "measured", "grouped_mm"),
    ),
    "sm_100_without_torchao": (
        (10, 0),
        Software(torchao=False),
        ("emulated", "emulated", "native", "measured", "grouped_mm"),
    ),
    "sm_100_torchao_without_kernels": (
        (10, 0),
        Software(torchao_mxfp8_kernels=False),
        ("emulated", "emulated", "native", "measured", "grouped_mm"),
    ),
    "sm_100_nothing_installed": (
        (10, 0),
        NOTHING,
        ("emulated", "emulated", "native", "torch", "grouped_mm"),
    ),
}


@pytest.mark.parametrize(("capability", "software", "expected"), TABLE.values(), ids=TABLE)
def test_each_device_runs_the_kernels_its_capability_and_software_allow(
    capability, software, expected
):
    paths = kernel_paths(capability, software)
    got = tuple(
        choice.name
        for choice in (
            paths.mxfp8,
            paths.fp8_rowwise,
            paths.fp8_linear,
            paths.grouped_mm,
            paths.expert_gemm,
        )
    )
    assert got == expected
    assert paths.device == ("cpu" if capability is None else f"sm_{capability[0]}{capability[1]}")
    for path in ("mxfp8", "fp8_rowwise", "grouped_mm"):
        assert paths.runs_in_fp8(path) == (
            path != "grouped_mm" and paths.gemm_kernel(path).name != "emulated"
        )
    assert paths.runs_in_fp8(paths.expert_gemm.name) == (paths.expert_gemm.name != "grouped_mm")


def test_each_fallback_says_why_in_words():
    assert kernel_paths((9, 0)).mxfp8.reason == "the GPU is sm_90; torchao's MXFP8 needs sm_100"
    assert "CUDA 12.6" in kernel_paths((10, 0), Software(cuda=(12, 6))).mxfp8.reason
    assert "without CUDA" in kernel_paths((10, 0), Software(cuda=None)).mxfp8.reason
    assert "not installed" in kernel_paths((10, 0), Software(torchao=False)).mxfp8.reason
    assert "_scaled_grouped_mm" in kernel_paths((9, 0), NOTHING).fp8_rowwise.reason
    assert kernel_paths(None).fp8_linear.reason == "the device is a CPU"
    assert str(kernel_paths((8, 0)).fp8_linear) == (
        "emulated (the GPU is sm_80; FP8 needs sm_89 or newer)"
    )


def test_fp8_expert_gemms_need_bf16_compute():
    paths = kernel_paths((10, 0))
    assert paths.auto_expert_gemm("bfloat16").name == "mxfp8"
    fp32 = paths.auto_expert_gemm("float32")
    assert fp32.name == "grouped_mm" and "float32 compute" in fp32.reason


@pytest.mark.parametrize("bad", [(9,), (9, 0, 1), ("9", "0"), (-1, 0)])
def test_a_bad_capability_is_one_clear_error(bad):
    with pytest.raises(ValueError, match=r"^capability=.* must be \(major, minor\)"):
        kernel_paths(bad)


def test_moe_devices_imports_and_answers_without_torch():
    """With torch blocked (a meta-path finder refusing it), moe_devices imports and answers."""
    script = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ImportError("torch is blocked")
sys.meta_path.insert(0, NoTorch())
import moe_devices
print(moe_devices.kernel_paths((10, 0)).expert_gemm.name)
assert not any(name.split(".")[0] == "torch" for name in sys.modules), "torch was imported"
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "mxfp8"
