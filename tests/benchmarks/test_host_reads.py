"""benchmarks/host_reads.py and its counter: every kind of host read is seen where it is made,
reads of host copies are not, and on ep2 the rowwise MoE layer reads nothing while
all_to_all's reads are seen."""

from __future__ import annotations

import json

import pytest
import torch

import host_reads
from harness.host_reads import HostReadCounter


def _reads(counter: HostReadCounter) -> list[str]:
    return [read.what for read in counter.reads]


def test_each_kind_of_host_read_is_counted_at_its_site():
    counts = torch.tensor([1, 0, 2, 3])
    weight = torch.randn(4, requires_grad=True)
    with HostReadCounter() as counter:
        counts[0].item()
        bool(counts[1])
        counts.tolist()
        counts.cpu()
        counts.nonzero()
        torch.repeat_interleave(counts)
        torch.bincount(counts)
        weight[counts > 0].sum().backward()  # a mask index, and its backward's index_put
    assert _reads(counter) == [
        "item",
        "item",
        "tolist",
        "cpu",
        "nonzero",
        "repeat_interleave",
        "bincount",
        "index (by a mask)",
        "index_put (by a mask)",
    ]
    site = "test_host_reads.py:test_each_kind_of_host_read_is_counted_at_its_site"
    assert {read.site for read in counter.reads} == {site}


def test_what_needs_no_values_and_reads_of_host_copies_are_not_counted():
    counts = torch.tensor([1, 0, 2, 3])
    with HostReadCounter() as counter:
        torch.repeat_interleave(counts, counts, output_size=6)  # the size is given
        torch.repeat_interleave(counts, 2)
        counts[torch.tensor([0, 2])]  # an index by positions
        (counts * 2).cumsum(0).max()
        host = counts.cpu()  # the one read
        host[2:].sum().item()
        torch.where(host > 0, host, 1).tolist()  # a host tensor and a wrapped number
    assert _reads(counter) == ["cpu"]


def test_the_counter_leaves_torch_as_it_was():
    before = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy")}
    with HostReadCounter():
        pass
    assert {name: getattr(torch.Tensor, name) for name in before} == before


@pytest.mark.slow
def test_rowwise_moe_layer_reads_nothing_on_the_host_and_all_to_all_is_seen(tmp_path, capsys):
    out = tmp_path / "reads.json"
    assert host_reads.main(["--json", str(out)]) == 0
    results = {(r["dispatcher"], r["transport"]): r for r in json.loads(out.read_text())}
    assert set(results) == {
        ("all_to_all", None),
        ("all_to_all_dedup", None),
        ("rowwise", "symmetric_memory"),
        ("rowwise", "all_to_all"),
    }
    for transport in ("symmetric_memory", "all_to_all"):
        rowwise = results["rowwise", transport]
        assert (rowwise["forward_host_reads"], rowwise["backward_host_reads"]) == (0, 0), rowwise
    all_to_all = results["all_to_all", None]
    assert all_to_all["sites"]["forward"] == {"moe_dispatch/all_to_all.py:_dispatch (tolist)": 1}
    # every MoE layer and micro-batch of the step reads its splits: 2 layers x 2 micro-batches
    assert all_to_all["sites"]["step"]["moe_dispatch/all_to_all.py:_dispatch (tolist)"] == 4
    for result in results.values():
        assert result["step_host_reads"] == sum(result["sites"]["step"].values()) > 0
        cpu_only = result["cpu_only_sites"]["backward"]
        assert cpu_only and all(site.startswith("moe_kernels/grouped_mm.py") for site in cpu_only)
    printed = capsys.readouterr().out
    assert "rowwise           symmetric_memory        0         0" in printed
