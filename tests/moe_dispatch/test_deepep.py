"""The deepep backend without DeepEP: a clear BackendUnavailable, raised at the point of use."""

from __future__ import annotations

import sys

import pytest

from moe_dispatch import BackendUnavailable, DeepEPDispatcher, make_dispatcher


@pytest.fixture
def without_deep_ep(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import deep_ep`` fails, even on a host where it happens to be built."""
    monkeypatch.setitem(sys.modules, "deep_ep", None)


def test_make_dispatcher_deepep_raises_backend_unavailable(without_deep_ep: None) -> None:
    with pytest.raises(BackendUnavailable) as raised:
        make_dispatcher("deepep", num_experts=8)
    message = str(raised.value)
    assert "\n" not in message
    for words in ("parallel.dispatcher=deepep", "built from source", "NVSHMEM", "README"):
        assert words in message
    assert "use all_to_all or rowwise" in message
    assert isinstance(raised.value.__cause__, ImportError)


def test_constructing_the_dispatcher_checks_the_library_before_anything_else(
    without_deep_ep: None,
) -> None:
    with pytest.raises(BackendUnavailable, match="needs DeepEP"):
        DeepEPDispatcher(8, group=None)
