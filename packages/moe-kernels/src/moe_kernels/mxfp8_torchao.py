"""moe-kernels' glue to torchao's MXFP8 grouped GEMM (SM100 kernels, or torchao's emulation).

torchao's autograd function (``_MXFP8GroupedMM``) keeps for backward the column-major weight
copy it is given and its input padded to whole blocks per expert: per micro-batch in flight, a
copy of the local experts' weights and of the input. The glue calls that function's forward and
backward itself, keeps x, w and the offsets, and rebuilds both copies in backward.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from moe_kernels.grouped_mm import _padding_rows_mask
from moe_kernels.torchao_import import quiet_torchao_import

TORCHAO_MXFP8_BLOCK = 32
"""torchao's MXFP8 block size, and the row alignment of its token groups."""
_TORCHAO_INSTALL_HINT = "pip install 'moestack-kernels[mxfp8]'"


def _torchao_moe_training() -> ModuleType:
    """``torchao.prototype.moe_training``, imported on first use (the ``mxfp8`` extra)."""
    try:
        with quiet_torchao_import():
            from torchao.prototype import moe_training
    except ImportError as e:
        raise ImportError(
            "mxfp8_grouped_mm kernel='torchao' needs torchao: "
            f"{_TORCHAO_INSTALL_HINT} (or use kernel='emulated')"
        ) from e
    return moe_training


class _TorchaoContext:
    """Stands in for an autograd context when torchao's MXFP8 forward and backward are called:
    records what the forward saves and sets, and gives the backward the tensors rebuilt."""

    saved_tensors: tuple[Tensor, ...] = ()

    def save_for_backward(self, *tensors: Tensor) -> None:
        self.saved_tensors = tensors


def _torchao_operands(
    x_TK: Tensor, w_EKN: Tensor, offsets_E: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(padding-row mask, x with those rows zeroed, w column-major, offsets covering all rows).

    torchao wants w per expert column-major ([E, N, K] storage), and groups that cover all
    rows: the padding rows, zeroed, join the last group (zero rows change no block scale and
    add nothing to its weight gradient).
    """
    padding_T1 = _padding_rows_mask(x_TK.shape[0], offsets_E)
    if not w_EKN.transpose(-2, -1).is_contiguous():
        w_EKN = w_EKN.transpose(-2, -1).contiguous().transpose(-2, -1)
    offsets_all_rows_E = offsets_E.clone()
    offsets_all_rows_E[-1] = x_TK.shape[0]
    return padding_T1, x_TK.masked_fill(padding_T1, 0), w_EKN, offsets_all_rows_E


class _TorchaoMxfp8GroupedMm(torch.autograd.Function):
    """torchao's MXFP8 grouped GEMM (its own forward and backward) keeping only x, w and the
    offsets for backward.

    torchao's autograd function saves the column-major weight copy it is given and its
    block-padded input: a copy of the local experts' weights and of the input per micro-batch
    in flight. Here both are rebuilt in backward from the saved inputs (the same operations
    on the same values, so the same bytes); the output and gradients are torchao's.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x_TK: Tensor,
        w_EKN: Tensor,
        offsets_E: Tensor,
        scale_mode: str,
        kernel_preference: str,
    ) -> Tensor:
        with quiet_torchao_import():
            from torchao.prototype.moe_training.mxfp8_grouped_mm import _MXFP8GroupedMM
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.quantization.quantize_.common import KernelPreference

        padding_T1, x_rows, w_columns, offsets_all_rows_E = _torchao_operands(
            x_TK, w_EKN, offsets_E
        )
        record = _TorchaoContext()
        out_TN = _MXFP8GroupedMM.forward(
            record,
            x_rows,
            w_columns,
            offsets_all_rows_E,
            x_TK.dtype,
            KernelPreference(kernel_preference),
            False,  # wgrad_with_hp
            ScaleCalculationMode(scale_mode),
            True,  # pad_token_groups_for_grouped_mm
        )
        saved = record.saved_tensors
        if len(saved) != 5 or saved[1] is not w_columns or saved[2] is not offsets_all_rows_E:
            raise RuntimeError(
                "mxfp8_grouped_mm: torchao's _MXFP8GroupedMM saves other tensors than the "
                "torchao 0.18 this glue rebuilds them for; use kernel='emulated'"
            )
        del record.saved_tensors
        ctx.torchao_attributes = vars(record)
        ctx.save_for_backward(x_TK, w_EKN, offsets_E)
        return out_TN.masked_fill(padding_T1, 0)

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx, grad_out_TN: Tensor
    ) -> tuple[Tensor, Tensor, None, None, None]:
        with quiet_torchao_import():
            from torchao.prototype.moe_training.mxfp8_grouped_mm import _MXFP8GroupedMM
            from torchao.prototype.moe_training.utils import pad_token_groups

        x_TK, w_EKN, offsets_E = ctx.saved_tensors
        padding_T1, x_rows, w_columns, offsets_all_rows_E = _torchao_operands(
            x_TK, w_EKN, offsets_E
        )
        replay = _TorchaoContext()
        vars(replay).update(ctx.torchao_attributes)
        padded_x, padded_starts_E, padded_ends_E = pad_token_groups(
            x_rows,
            offsets_all_rows_E,
            alignment_size=TORCHAO_MXFP8_BLOCK,
            kernel_preference=replay.kernel_preference,
        )
        replay.saved_tensors = (
            padded_x,
            w_columns,
            offsets_all_rows_E,
            padded_starts_E,
            padded_ends_E,
        )
        grad_x_TK, grad_w_EKN = _MXFP8GroupedMM.backward(
            replay, grad_out_TN.masked_fill(padding_T1, 0)
        )[:2]
        starts_E = F.pad(offsets_E[:-1], (1, 0))
        return (
            grad_x_TK.masked_fill(padding_T1, 0),
            grad_w_EKN.masked_fill((offsets_E == starts_E)[:, None, None], 0),
            None,
            None,
            None,
        )


def _torchao_grouped_mm(
    x_TK: Tensor,
    w_EKN: Tensor,
    offsets_E: Tensor,
    scale_mode: str,
    kernel_preference: str,
) -> Tensor:
    """torchao's MXFP8 grouped GEMM (``kernel_preference`` "auto": SM100 kernels, "emulated").

    Rows past ``offsets[-1]`` give zero output and input gradient, empty groups a zero weight
    gradient. Keeps for backward what the emulation keeps: x, w and the offsets.
    """
    _torchao_moe_training()
    return _TorchaoMxfp8GroupedMm.apply(x_TK, w_EKN, offsets_E, scale_mode, kernel_preference)
