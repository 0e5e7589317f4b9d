"""The ``reports`` fixture of the expert-parallel dispatch tests (see ep_checks.py)."""

import pytest
from ep_checks import Report, ep_reports


@pytest.fixture(scope="module", params=[2, 4], ids=lambda ep: f"ep{ep}")
def reports(request: pytest.FixtureRequest) -> list[Report]:
    """Every rank's report of the one spawn at ep 2 and 4 (a file may define its own)."""
    return ep_reports(request.param)
