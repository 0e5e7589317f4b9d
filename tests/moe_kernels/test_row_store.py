"""store_rows on both backends against a per-row loop: used rows get their source rows, and
unused rows keep whatever they held (NaN included). Without CUDA the Triton kernel runs
under the interpreter (conftest.py)."""

from __future__ import annotations

import pytest
import torch

from moe_kernels import ROW_STORE_BACKENDS, store_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(rows: int, sources: int, dim: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    source_ND = torch.randn(sources, dim, generator=generator).to(dtype)
    index_R = torch.randint(0, sources, (rows,), generator=generator)
    used_R = torch.rand(rows, generator=generator) < 0.6
    dest_RD = torch.full((rows, dim), float("nan"), dtype=dtype)
    dest_RD[::3] = 7.0  # unused rows keep finite values and NaN alike
    return dest_RD, source_ND, index_R, used_R


@pytest.mark.parametrize("backend", ROW_STORE_BACKENDS)
@pytest.mark.parametrize(
    ("rows", "sources", "dim", "dtype"),
    [(45, 20, 24, torch.float32), (70, 9, 80, torch.bfloat16), (1, 1, 1, torch.float32)],
)
def test_used_rows_are_stored_and_the_others_are_left_alone(backend, rows, sources, dim, dtype):
    dest_RD, source_ND, index_R, used_R = _case(rows, sources, dim, dtype, rows + dim)
    expected_RD = dest_RD.clone()
    for r in range(rows):  # the reference: one row at a time
        if used_R[r]:
            expected_RD[r] = source_ND[index_R[r]]
    index_R = torch.where(used_R, index_R, -5 if backend == "triton" else 0)  # unread there
    dest_RD, source_ND = dest_RD.to(DEVICE), source_ND.to(DEVICE)
    store_rows(dest_RD, source_ND, index_R.to(DEVICE), used_R.to(DEVICE), backend)
    assert torch.equal(dest_RD.cpu().isnan(), expected_RD.isnan())
    assert torch.equal(dest_RD.cpu().nan_to_num(), expected_RD.nan_to_num())


def test_a_peer_block_view_is_written_in_place():
    """The transports hand a block of a larger buffer: the store lands in the buffer."""
    buffer_PRD = torch.zeros(3, 4, 2)
    used_R = torch.tensor([True, False, True, False])
    store_rows(buffer_PRD[1], torch.ones(2, 2), torch.tensor([0, 0, 1, 1]), used_R)
    assert buffer_PRD.sum(dim=2).tolist() == [[0] * 4, [2, 0, 2, 0], [0] * 4]


def test_bad_arguments_are_refused_with_one_line():
    dest_RD = torch.zeros(4, 2)
    with pytest.raises(ValueError, match=r"index and used must be \[4\]"):
        store_rows(dest_RD, torch.zeros(2, 2), torch.zeros(3, dtype=torch.int64), torch.ones(4))
    with pytest.raises(ValueError, match="backend='cuda' is not a row-store backend"):
        used_R = torch.ones(4, dtype=torch.bool)
        store_rows(dest_RD, torch.zeros(2, 2), torch.zeros(4, dtype=torch.int64), used_R, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_triton_store_on_a_gpu_is_sync_free_and_equals_the_torch_store():
    dest_RD, source_ND, index_R, used_R = _case(300, 64, 256, torch.bfloat16, 3)
    dest_RD, source_ND, index_R, used_R = (t.cuda() for t in (dest_RD, source_ND, index_R, used_R))
    expected_RD = dest_RD.clone()
    store_rows(expected_RD, source_ND, index_R, used_R, "torch")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        store_rows(dest_RD, source_ND, index_R, used_R, "triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(dest_RD.isnan(), expected_RD.isnan())
    assert torch.equal(dest_RD.nan_to_num(), expected_RD.nan_to_num())
