"""The page's plan ranks only the fastest layouts, and the layouts of one plan share what they
have alike: the same rows, in the same order, as the plain computation."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_plan import DEVICES, make_plan, predict_memory
from moe_plan.cli import plan_json_of, plan_words_of
from moe_plan.config import load_config
from moe_plan.layouts import Shared, candidate_layouts, screen, with_figures
from moe_plan.ranking import fastest, speed_bounds
from moe_plan.report import ranked_to
from moe_plan.serve import Planner

ROOT = Path(__file__).resolve().parents[2]
CASES = [
    ("published-qwen3-30b-a3b-b200.yaml", 8, "b200"),  # MXFP8 twins of auto expert GEMMs
    ("published-qwen3-30b-a3b-h100.yaml", 16, "h100"),
    ("olmoe-1b-7b.yaml", 8, "h100"),
]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def full(request):
    """A case's config, devices, device kind and its plan with every layout ranked."""
    name, gpus, gpu = request.param
    config = load_config(ROOT / "configs" / name)
    return config, gpus, DEVICES[gpu], make_plan(config, gpus, DEVICES[gpu], search=False)


def _rows(layouts):
    return [(r.label, r.tokens_per_s, r.memory) for r in layouts]


def test_speed_bound_is_at_least_the_speed(full):
    """Every layout that fits runs no faster than its bound (the bound is what lets the
    ranking skip layouts)."""
    config, _, device, plan = full
    shared = Shared.of(config)
    bounds = speed_bounds(plan.fitting, device, shared)
    assert len(plan.fitting) > 25
    assert all(b >= r.tokens_per_s for b, r in zip(bounds, plan.fitting, strict=True))
    assert max(b / r.tokens_per_s for b, r in zip(bounds, plan.fitting, strict=True)) > 1


@pytest.mark.parametrize("n", [1, 3, 25])
def test_fastest_are_the_first_of_the_full_ranking(full, n):
    """The first n ranked of a partly ranked plan are the full ranking's first n, ties in
    the same order; ranking more of it, and all of it, gives the full ranking's rows."""
    config, gpus, device, plan = full
    part = make_plan(config, gpus, device, search=False, ranked=n)
    assert _rows(part.fitting) == _rows(plan.fitting[:n])
    assert part.fitting_count == plan.fitting_count == len(plan.fitting)
    assert {r.label for r in part.unranked} == {r.label for r in plan.fitting[n:]}
    assert _rows(ranked_to(part, n + 7).fitting) == _rows(plan.fitting[: n + 7])
    assert _rows(ranked_to(part, 10**6).fitting) == _rows(plan.fitting)
    # Some layouts were never given their figures: the bound did skip them.
    assert any(r.time is None for r in part.unranked)


def test_fastest_keeps_ties_in_their_order():
    """Layouts of equal speed come in the order given, whichever the bound visits first."""
    config = load_config(ROOT / "configs/published-qwen3-30b-a3b-b200.yaml")
    device, shared = DEVICES["b200"], Shared.of(config)
    fitting = [r for c in candidate_layouts(config, 8, device) if (r := screen(c, 8, device)).fits]
    figured = [with_figures(r, device) for r in fitting]
    speeds = [r.tokens_per_s for r in figured]
    assert len(set(speeds)) < len(speeds)  # the MXFP8 twins run at the same speed
    for order in (fitting, fitting[::-1]):
        top, _ = fastest(order, device, 10, shared)
        expected = sorted((with_figures(r, device) for r in order), key=lambda r: -r.tokens_per_s)
        assert [r.label for r in top] == [r.label for r in expected[:10]]


def test_shared_memory_and_figures_are_each_layouts_own(full):
    """A plan's layouts screened and given their figures with what they share have the
    memory and figures each has alone."""
    config, gpus, device, _ = full
    shared = Shared.of(config)
    checked = 0
    for candidate in candidate_layouts(config, gpus, device):
        alone = screen(candidate, gpus, device)
        together = screen(candidate, gpus, device, shared=shared)
        assert (together.error, together.memory) == (alone.error, alone.memory), alone.label
        if alone.error is None:
            assert together.memory == predict_memory(alone.config, gpus)
            assert _figures(with_figures(together, device, shared)) == _figures(
                with_figures(alone, device)
            )
            checked += 1
    # Where MXFP8 runs, the MXFP8 twin of each auto layout shares its prediction.
    assert checked == (2 if device.mxfp8 else 1) * len(shared.memory)


def _figures(r):
    return r.label, r.traffic, r.time, r.tokens_per_s, r.mfu


def test_page_rows_are_the_json_rows():
    """The page's first rows and the rows it asks for later are `plan --json`'s rows."""
    name = "published-qwen3-30b-a3b-b200.yaml"
    planner = Planner(plan_words_of, {name: ROOT / "configs" / name})
    request = {"config": name, "gpu": "b200", "gpus": "8", "tokens": "1e12"}
    page = planner.plan(request)
    argv = page["argv"][1:-1]
    whole = plan_json_of(argv, search=False)
    assert page["plan"]["fitting"] == whole["fitting"][:25]
    more = planner.rows({**request, "list": "fitting", "start": 20, "count": 40})
    assert more["rows"] == whole["fitting"][20:60]
    assert more["total"] == page["plan"]["fitting_count"] == len(whole["fitting"])
    label = whole["fitting"][-1]["layout"]  # never ranked by the first answer
    assert planner.layout({**request, "layout": label})["layout"] == whole["fitting"][-1]
