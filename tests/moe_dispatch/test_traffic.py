"""Traffic: the counts of the exchanges, added on the host and on the device, taken once."""

from __future__ import annotations

import torch

from harness.host_reads import HostReadCounter
from moe_dispatch import TakenTraffic, Traffic


def test_counts_add_up_by_kind_and_a_take_starts_again():
    traffic = Traffic()
    traffic.count(100, dispatch=True)
    traffic.count(torch.tensor(7, dtype=torch.int32), dispatch=True)
    traffic.count(30, dispatch=False)
    traffic.count(torch.tensor(5), dispatch=False)
    taken = traffic.take()
    assert taken.host_2 == (100, 130) and taken.device_2.dtype == torch.int64
    assert taken.tolist() == [107, 142]
    assert traffic.take() == ((0, 0), None)


def test_counts_known_on_the_host_make_no_tensor():
    traffic = Traffic()
    traffic.count(64, dispatch=True)
    traffic.count(32, dispatch=False)
    assert traffic.take() == ((64, 96), None)


def test_counting_what_the_device_knows_reads_nothing_on_the_host():
    traffic = Traffic()
    rows_kept = torch.tensor([3, 4]).sum()  # made outside the counter: a device tensor to it
    with HostReadCounter() as counter:
        traffic.count(rows_kept * 16, dispatch=False)
        traffic.count(rows_kept * 2, dispatch=True)
        traffic.count(8, dispatch=True)
        taken = traffic.take()
    assert counter.reads == []
    assert taken.tolist() == [22, 134]


def test_takes_add_host_parts_as_integers_and_device_parts_on_the_device():
    host_only = TakenTraffic((10, 20), None)
    device_part = TakenTraffic((1, 2), torch.tensor([100, 200]))
    assert host_only.plus(host_only) == ((20, 40), None)
    with HostReadCounter() as counter:
        both = host_only.plus(device_part).plus(device_part)
    assert counter.reads == []
    assert both.host_2 == (12, 24)
    assert both.tolist() == [212, 424]
    assert device_part.plus(host_only).tolist() == [111, 222]
