"""How a dispatch's token rows travel: in their own dtype, or as FP8 (``dispatch_dtype``).

FP8 rows are e4m3 values with one power-of-two scale per row, quantized by moe-kernels'
rowwise rule (`moe_kernels.to_fp8_rowwise`, the rule the rowwise FP8 expert GEMMs apply to
their inputs), and travel as bytes: a row of D values is D bytes of e4m3 and 4 bytes of its
fp32 multiplier ``1 / scale``, so a row of zero bytes (an unused slot, alignment padding)
decodes to zeros. Decoding is exact (the multiplier is a power of two), so every copy of a
token arrives as the same rounded row whichever rank holds its expert; without expert
parallelism the rows are rounded the same way (`round_trip`), so layouts agree.

Only the forward dispatch is FP8: its backward (the rows' gradients) and the combine stay in
the compute dtype, and the rounding's gradient is taken as the identity (straight through).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from moe_kernels import to_fp8_rowwise

__all__ = ["DISPATCH_DTYPES", "DispatchDtype", "Fp8Rows", "row_wire"]

DispatchDtype = Literal["compute", "fp8"]
"""``compute``: rows travel in the dtype they have (the compute dtype); ``fp8``: as
`Fp8Rows`."""
DISPATCH_DTYPES: tuple[str, ...] = get_args(DispatchDtype)

_MULTIPLIER_BYTES = 4


class Fp8Rows:
    """Rows as ``[N, D + 4]`` bytes: e4m3 values, then the row's fp32 multiplier."""

    name = "fp8"

    def encode(self, rows_ND: Tensor) -> Tensor:
        """[N, D] fp32 or bf16 -> [N, D + 4] uint8."""
        data_ND, scales_N1 = to_fp8_rowwise(rows_ND)
        multiplier_N1 = scales_N1.reciprocal()  # exact: the scales are powers of two
        return torch.cat(
            [data_ND.view(torch.uint8), multiplier_N1.view(torch.uint8)], dim=1
        ).contiguous()

    def decode(self, wire_NW: Tensor, dtype: torch.dtype) -> Tensor:
        """[N, D + 4] uint8 -> [N, D] rows in ``dtype`` (exact before the cast)."""
        data_ND = wire_NW[:, :-_MULTIPLIER_BYTES].contiguous().view(torch.float8_e4m3fn)
        multiplier_N1 = wire_NW[:, -_MULTIPLIER_BYTES:].contiguous().view(torch.float32)
        return (data_ND.float() * multiplier_N1).to(dtype)

    def round_trip(self, rows_ND: Tensor) -> Tensor:
        """The rows as a receiver decodes them, with the gradient passed straight through."""
        return _RoundTrip.apply(rows_ND, self)


class _RoundTrip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_ND: Tensor, wire: Fp8Rows) -> Tensor:  # type: ignore[override]
        return wire.decode(wire.encode(rows_ND), rows_ND.dtype)

    @staticmethod
    def backward(ctx, grad_ND: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad_ND, None


def row_wire(dispatch_dtype: str, backend: str) -> Fp8Rows | None:
    """The wire format of ``dispatch_dtype`` (None: rows in their own dtype); ValueError
    naming ``backend`` for an unknown one."""
    if dispatch_dtype not in DISPATCH_DTYPES:
        raise ValueError(
            f"{backend}: dispatch_dtype={dispatch_dtype!r} is not one of "
            f"{', '.join(DISPATCH_DTYPES)}"
        )
    return Fp8Rows() if dispatch_dtype == "fp8" else None
