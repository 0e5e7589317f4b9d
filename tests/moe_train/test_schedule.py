"""Learning-rate schedules: linear warmup to the peak, then cosine, linear, warmup-stable-decay
or constant, against hand-worked values and a reference written from the documentation."""

import math

import pytest

from moe_plan.config import OptimConfig, config_from_dict
from moe_train.cli import main
from moe_train.errors import ConfigError
from moe_train.train.schedule import lr_at
from training import CONFIGS


def _expected_lr(step: int, lr: float, warmup: int, min_ratio: float, max_steps: int) -> float:
    """The schedule as written in words: warmup step s (0-based) takes lr * (s + 1) / warmup,
    so the first step already moves and step warmup - 1 is at the peak; the decay steps
    warmup .. max_steps - 1 follow a half cosine from lr down to lr * min_ratio."""
    if step < warmup:
        return lr * (step + 1) / warmup
    last = max_steps - 1
    fraction = 0.0 if last == warmup else min(1.0, (step - warmup) / (last - warmup))
    floor = lr * min_ratio
    return floor + (lr - floor) * (1 + math.cos(math.pi * fraction)) / 2


def _schedule(lr=2e-3, warmup=4, min_ratio=0.1, max_steps=13) -> list[float]:
    optim = OptimConfig(lr=lr, warmup_steps=warmup, min_lr_ratio=min_ratio)
    return [lr_at(step, optim, max_steps) for step in range(max_steps)]


def test_hand_worked_values():
    # lr 1, warmup 4, 13 steps: the decay runs over steps 4..12, so step 6 is a quarter of the
    # way, 0.1 + 0.9 * (1 + cos(pi / 4)) / 2 (not the 0.775 of a linear decay), step 8 half
    # way down the cosine, (1 + 0.1) / 2, and step 12 is the floor 0.1.
    got = _schedule(lr=1.0, warmup=4, min_ratio=0.1, max_steps=13)
    quarter = 0.1 + 0.9 * (1 + math.sqrt(0.5)) / 2
    expected = {0: 0.25, 1: 0.5, 2: 0.75, 3: 1.0, 4: 1.0, 6: quarter, 8: 0.55, 12: 0.1}
    for step, want in expected.items():
        assert got[step] == pytest.approx(want, rel=1e-12), f"step {step}: {got[step]} vs {want}"


@pytest.mark.parametrize(
    ("lr", "warmup", "min_ratio", "max_steps"),
    [(2e-3, 4, 0.1, 13), (3e-4, 10, 0.0, 50), (1e-2, 1, 0.5, 7), (5e-4, 0, 0.1, 20)],
)
def test_every_step_matches_the_formula(lr, warmup, min_ratio, max_steps):
    got = _schedule(lr, warmup, min_ratio, max_steps)
    for step, value in enumerate(got):
        want = _expected_lr(step, lr, warmup, min_ratio, max_steps)
        assert value == pytest.approx(want, rel=1e-12), f"step {step}: {value} vs {want}"


def test_warmup_starts_above_zero_and_peaks_at_its_last_step():
    got = _schedule(lr=2e-3, warmup=4, max_steps=13)
    assert got[0] == pytest.approx(2e-3 / 4, rel=1e-12), f"step 0: {got[0]} vs lr / warmup"
    assert got[3] == pytest.approx(2e-3, rel=1e-12), f"last warmup step: {got[3]} vs the peak"
    assert got[4] == pytest.approx(2e-3, rel=1e-12), f"first decay step: {got[4]} vs the peak"


def test_last_step_reaches_the_floor_and_later_steps_stay_there():
    optim = OptimConfig(lr=2e-3, warmup_steps=4, min_lr_ratio=0.1)
    for step in (12, 13, 40):
        got = lr_at(step, optim, 13)
        assert got == pytest.approx(2e-4, rel=1e-12), f"step {step} of 13: {got} vs 2e-4"


def test_rises_through_warmup_and_falls_through_decay():
    got = _schedule(lr=2e-3, warmup=5, min_ratio=0.1, max_steps=30)
    for step in range(1, 5):
        assert got[step] > got[step - 1], f"warmup step {step}: {got[step]} <= {got[step - 1]}"
    for step in range(6, 30):
        assert got[step] < got[step - 1], f"decay step {step}: {got[step]} >= {got[step - 1]}"


def test_no_warmup_starts_at_the_peak():
    got = _schedule(lr=2e-3, warmup=0, min_ratio=0.1, max_steps=10)
    assert got[0] == pytest.approx(2e-3, rel=1e-12), f"step 0: {got[0]} vs the peak 2e-3"
    assert got[-1] == pytest.approx(2e-4, rel=1e-12), f"last step: {got[-1]} vs the floor"


# ---- cosine, linear, wsd and constant; decay_steps ---------------------------------------------


def _original_cosine(step: int, lr: float, warmup: int, min_ratio: float, max_steps: int) -> float:
    """The cosine schedule's arithmetic, operation for operation, from before optim.schedule
    existed: with the default decay_steps it must still give the same bits, since training tests
    compare losses bitwise between runs."""
    if step < warmup:
        return lr * (step + 1) / warmup
    decay_steps = max(1, max_steps - warmup - 1)
    progress = min(1.0, (step - warmup) / decay_steps)
    floor = lr * min_ratio
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _reference_lr(
    step: int,
    schedule: str,
    lr: float,
    warmup: int,
    min_ratio: float,
    max_steps: int,
    decay_steps: int | None,
) -> float:
    """Each schedule in words: after the warmup, a decay of D steps, its first step at the peak
    and its last at the floor lr * min_ratio, then the floor. cosine and linear decay from the
    end of the warmup, over D = decay_steps steps or, when that is None, up to the last step;
    wsd holds the peak, then decays linearly over the last D = decay_steps steps; constant
    holds the peak."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    floor = lr * min_ratio
    if schedule == "wsd":
        first = max_steps - decay_steps
    else:
        first = warmup
        decay_steps = max_steps - warmup if decay_steps is None else decay_steps
    last = first + decay_steps - 1
    if step <= first:
        return lr
    if step >= last:
        return floor
    fraction = (step - first) / (last - first)
    if schedule == "cosine":
        return floor + (lr - floor) * (1 + math.cos(math.pi * fraction)) / 2
    return lr - (lr - floor) * fraction


def _lrs(schedule: str, steps: int, max_steps: int, **optim) -> list[float]:
    config = OptimConfig(schedule=schedule, **optim)
    config.validate("optim")
    return [lr_at(step, config, max_steps) for step in range(steps)]


def _assert_values(got: list[float], expected: dict[int, float], what: str) -> None:
    for step, want in expected.items():
        assert got[step] == pytest.approx(want, rel=1e-12, abs=1e-15), (
            f"{what}, step {step}: {got[step]} vs {want}"
        )


@pytest.mark.parametrize("min_ratio", [0.1, 0.0, 1.0])
@pytest.mark.parametrize("warmup", [0, 1, 3, 10, 40])
@pytest.mark.parametrize("max_steps", [1, 2, 3, 7, 11, 40, 41, 200])
def test_default_cosine_gives_the_original_bits(max_steps, warmup, min_ratio):
    optim = OptimConfig(lr=3e-4, warmup_steps=warmup, min_lr_ratio=min_ratio)
    assert optim.schedule == "cosine" and optim.decay_steps is None
    for step in range(max_steps + 5):
        got = lr_at(step, optim, max_steps)
        want = _original_cosine(step, 3e-4, warmup, min_ratio, max_steps)
        assert got == want, f"step {step} of {max_steps}, warmup {warmup}: {got!r} != {want!r}"


def test_cosine_with_decay_steps_hand_values():
    # lr 1, warmup 4, decay 5: the decay runs over steps 4..8 (progress (s - 4) / 4), step 6 half
    # way down, (1 + 0.1) / 2, step 5 a quarter, and step 8 = 4 + 5 - 1 is the floor, whatever
    # max_steps is, for every later step too.
    quarter = 0.1 + 0.9 * (1 + math.sqrt(0.5)) / 2
    expected = {0: 0.25, 3: 1.0, 4: 1.0, 5: quarter, 6: 0.55, 8: 0.1, 9: 0.1, 29: 0.1}
    got = _lrs("cosine", 30, 30, lr=1.0, warmup_steps=4, min_lr_ratio=0.1, decay_steps=5)
    _assert_values(got, expected, "cosine, decay_steps=5")
    assert got[7] > 0.1, f"step 7, one before the floor: {got[7]} is already at the floor"


def test_linear_hand_values():
    # lr 1, warmup 2, floor 0.1, 7 steps: the decay runs over steps 2..6 in equal drops of
    # 0.9 / 4 = 0.225, from the peak at step 2 to the floor at step 6.
    got = _lrs("linear", 9, 7, lr=1.0, warmup_steps=2, min_lr_ratio=0.1)
    expected = {0: 0.5, 1: 1.0, 2: 1.0, 3: 0.775, 4: 0.55, 5: 0.325, 6: 0.1, 7: 0.1, 8: 0.1}
    _assert_values(got, expected, "linear, decay up to max_steps")
    # The same decay given as decay_steps=5 in a run of 20 steps, then the floor.
    got = _lrs("linear", 20, 20, lr=1.0, warmup_steps=2, min_lr_ratio=0.1, decay_steps=5)
    _assert_values(got, {**expected, 12: 0.1, 19: 0.1}, "linear, decay_steps=5")


def test_wsd_hand_values():
    # lr 1, warmup 2, floor 0.1, 12 steps, decay 5: warmup 0..1, stable at the peak 2..6, the
    # decay over the last five steps 7..11 in drops of 0.225, the last step at the floor.
    got = _lrs("wsd", 15, 12, lr=1.0, warmup_steps=2, min_lr_ratio=0.1, decay_steps=5)
    expected = {0: 0.5, 1: 1.0, 2: 1.0, 4: 1.0, 6: 1.0, 7: 1.0, 8: 0.775, 9: 0.55, 10: 0.325}
    _assert_values(got, {**expected, 11: 0.1, 12: 0.1, 14: 0.1}, "wsd, decay_steps=5")


def test_wsd_decay_may_take_the_whole_run_after_warmup():
    # warmup + decay_steps == max_steps: no stable step, the decay starts right after warmup.
    got = _lrs("wsd", 6, 6, lr=1.0, warmup_steps=1, min_lr_ratio=0.0, decay_steps=5)
    _assert_values(got, {0: 1.0, 1: 1.0, 2: 0.75, 3: 0.5, 4: 0.25, 5: 0.0}, "wsd, no stable")


def test_constant_hand_values():
    got = _lrs("constant", 12, 10, lr=1.0, warmup_steps=3, min_lr_ratio=0.1)
    expected = {0: 1 / 3, 1: 2 / 3, 2: 1.0, 3: 1.0, 9: 1.0, 11: 1.0}
    _assert_values(got, expected, "constant, warmup 3")


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd", "constant"])
def test_no_warmup_starts_every_schedule_at_the_peak(schedule):
    decay = 3 if schedule == "wsd" else None
    got = _lrs(schedule, 10, 10, lr=2e-3, warmup_steps=0, decay_steps=decay)
    assert got[0] == 2e-3, f"{schedule}, step 0 without warmup: {got[0]} vs the peak 2e-3"


@pytest.mark.parametrize(
    ("schedule", "lr", "warmup", "min_ratio", "max_steps", "decay_steps"),
    [
        ("cosine", 2e-3, 4, 0.1, 40, 9),
        ("cosine", 3e-4, 0, 0.0, 30, 2),
        ("cosine", 1e-2, 5, 0.3, 20, 50),
        ("linear", 2e-3, 4, 0.1, 13, None),
        ("linear", 3e-4, 0, 0.0, 50, 17),
        ("linear", 1e-2, 7, 0.5, 8, None),
        ("wsd", 2e-3, 4, 0.1, 40, 8),
        ("wsd", 3e-4, 0, 0.0, 25, 25),
        ("wsd", 1e-2, 3, 0.2, 10, 2),
        ("constant", 2e-3, 4, 0.1, 13, None),
        ("constant", 3e-4, 0, 0.5, 5, None),
    ],
)
def test_every_step_matches_the_reference(schedule, lr, warmup, min_ratio, max_steps, decay_steps):
    optim = dict(lr=lr, warmup_steps=warmup, min_lr_ratio=min_ratio, decay_steps=decay_steps)
    got = _lrs(schedule, max_steps + 10, max_steps, **optim)
    for step, value in enumerate(got):
        want = _reference_lr(step, schedule, lr, warmup, min_ratio, max_steps, decay_steps)
        assert value == pytest.approx(want, rel=1e-12, abs=1e-15), (
            f"{schedule} step {step} of {max_steps}: {value} vs {want}"
        )


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
@pytest.mark.parametrize("max_steps", [6, 14, 15, 40])
def test_extending_a_run_with_decay_steps_keeps_its_past(schedule, max_steps):
    # warmup 3 + decay 12: the floor is reached at step 14. A run of N steps (ending before,
    # at, just after or well after that) and the same run raised to 2N steps on resume must
    # agree on every step they share, bit for bit, and sit at the floor from step 14 on.
    optim = dict(lr=3e-4, warmup_steps=3, min_lr_ratio=0.1, decay_steps=12)
    short = _lrs(schedule, max_steps, max_steps, **optim)
    extended = _lrs(schedule, 2 * max_steps, 2 * max_steps, **optim)
    for step in range(max_steps):
        assert short[step] == extended[step], (
            f"{schedule} step {step}: {short[step]!r} in a run of {max_steps} steps, "
            f"{extended[step]!r} once extended to {2 * max_steps}"
        )
    floor = 3e-4 * 0.1
    for step in range(14, 2 * max_steps):
        assert extended[step] == floor, f"{schedule} step {step}: {extended[step]!r} vs {floor!r}"
    if 2 * max_steps > 14:
        assert extended[13] > floor, f"{schedule} step 13: {extended[13]} is already the floor"


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_extending_a_run_without_decay_steps_stretches_its_decay(schedule):
    # The documented other side: with decay_steps null the decay ends on the last step, so a
    # run raised from 20 to 40 steps changes the learning rates of steps it already ran.
    optim = dict(lr=3e-4, warmup_steps=3, min_lr_ratio=0.1)
    short, extended = _lrs(schedule, 20, 20, **optim), _lrs(schedule, 20, 40, **optim)
    assert short[:4] == extended[:4], f"{schedule}: warmup and first decay step moved"
    assert extended[10] > short[10], f"{schedule} step 10: {extended[10]} vs {short[10]}"


def test_extending_a_wsd_run_keeps_its_stable_phase():
    # A wsd run of 30 steps decays over 25..29; extended to 60 it decays over 55..59: every
    # step before the first run's decay (0..24) is unchanged, bit for bit.
    optim = dict(lr=3e-4, warmup_steps=3, min_lr_ratio=0.1, decay_steps=5)
    short, extended = _lrs("wsd", 30, 30, **optim), _lrs("wsd", 60, 60, **optim)
    assert short[:25] == extended[:25], "wsd: the stable phase moved when the run was extended"
    assert short[26] < 3e-4, f"wsd step 26 of 30: {short[26]} has not started to decay"
    assert extended[26:55] == [3e-4] * 29, "wsd: the extended run's stable phase is not the peak"


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd"])
def test_decay_never_rises_and_ends_at_the_floor(schedule):
    got = _lrs(schedule, 60, 50, lr=2e-3, warmup_steps=5, min_lr_ratio=0.1, decay_steps=20)
    for step in range(6, 60):
        assert got[step] <= got[step - 1], f"{schedule} step {step}: {got[step]} > {got[step - 1]}"
    assert got[49] == pytest.approx(2e-4, rel=1e-12), f"{schedule} step 49: {got[49]} vs 2e-4"


# ---- config errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("optim", "max_steps", "message"),
    [
        (
            {"schedule": "cosinus"},
            100,
            "optim.schedule='cosinus' must be one of 'cosine', 'linear', 'wsd', 'constant'",
        ),
        (
            {"schedule": "wsd"},
            100,
            "optim.schedule=wsd needs optim.decay_steps, the length of the final decay",
        ),
        ({"schedule": "wsd", "decay_steps": 1}, 100, "optim.decay_steps=1 must be at least 2"),
        ({"decay_steps": 0}, 100, "optim.decay_steps=0 must be at least 2"),
        ({"schedule": "linear", "decay_steps": -5}, 100, "optim.decay_steps=-5 must be at least 2"),
        (
            {"schedule": "constant", "decay_steps": 10},
            100,
            "optim.decay_steps=10 has no effect with optim.schedule=constant",
        ),
        (
            {"schedule": "wsd", "decay_steps": 91, "warmup_steps": 10},
            100,
            "optim.warmup_steps=10 + optim.decay_steps=91 must be at most train.max_steps=100",
        ),
        (
            {"schedule": "wsd", "decay_steps": 20, "warmup_steps": 0},
            19,
            "optim.warmup_steps=0 + optim.decay_steps=20 must be at most train.max_steps=19",
        ),
    ],
)
def test_bad_schedules_are_one_line_naming_the_key(optim, max_steps, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"optim": optim, "train": {"max_steps": max_steps}})
    assert message in str(info.value), f"{str(info.value)!r} lacks {message!r}"
    assert "\n" not in str(info.value), f"not one line: {str(info.value)!r}"


def test_bad_schedule_built_in_code_fails_validate():
    # A config built in Python skips the YAML type check; validate still names the key.
    with pytest.raises(ConfigError, match=r"^optim\.schedule='step' must be one of 'cosine', "):
        OptimConfig(schedule="step").validate("optim")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("optim", "max_steps"),
    [
        ({"schedule": "wsd", "decay_steps": 90, "warmup_steps": 10}, 100),
        ({"schedule": "wsd", "decay_steps": 2, "warmup_steps": 0}, 2),
        ({"schedule": "cosine", "decay_steps": 500, "warmup_steps": 10}, 100),
        ({"schedule": "linear", "decay_steps": 2}, 100),
        ({"schedule": "constant"}, 100),
    ],
)
def test_valid_schedules_load(optim, max_steps):
    config = config_from_dict({"optim": optim, "train": {"max_steps": max_steps}})
    assert config.optim.schedule == optim["schedule"]
    assert config.optim.decay_steps == optim.get("decay_steps")


def test_bad_schedule_on_the_command_line_is_one_line(capsys, tmp_path):
    code = main(
        [
            "train",
            str(CONFIGS / "tiny.yaml"),
            f"--train.run_dir={tmp_path / 'r'}",
            "--optim.schedule=step",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2, f"exit code {code}, stderr {err!r}"
    assert err == (
        "error: optim.schedule='step' must be one of 'cosine', 'linear', 'wsd', 'constant'"
    ), err
