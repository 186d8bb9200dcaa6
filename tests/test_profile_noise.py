"""`--profile` measures its own noise: the spread of each stage's timed runs, with a warning on
stderr, and the figure, when the runs disagree too much to trust (a clock stands in for the
machine, so the test does not depend on this machine's load)."""

import itertools

import pytest
import torch
from torch import fx, nn

from pipec.frontend import profile
from pipec.frontend.profile import NOISE_LIMIT, profile_stages, spread

WARMUP, RUNS = 1, 5


def fake_clock(monkeypatch, run_ms: list[float]) -> None:
    """`profile_stages`' clock: run k's F, B and W each take a third of run_ms[k] (the
    warm-up's first), whatever the stage really does."""
    steps = itertools.chain.from_iterable(
        (0.0, ms / 3e3, ms / 3e3, ms / 3e3) for ms in itertools.cycle(run_ms)
    )
    now = itertools.accumulate(steps)
    monkeypatch.setattr(profile, "_now", lambda device: next(now))


def timed(monkeypatch, run_ms: list[float]) -> list:
    fake_clock(monkeypatch, run_ms)
    stage = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    x = torch.randn(3, 4)
    return profile_stages([stage], [(x,)], lambda y: y.sum(), RUNS, WARMUP, progress=False)


def test_a_noisy_profile_warns_with_its_spread(monkeypatch, capsys):
    # The warm-up, then 2, 2, 2, 4, 6 ms: median 2, spread (6 - 2) / 2 = 200 %.
    (costs,) = timed(monkeypatch, [9.0, 2.0, 2.0, 2.0, 4.0, 6.0])
    assert costs.F == pytest.approx(2e-3 / 3)  # the median run's, the warm-up left out
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pipec: warning: the profile is too noisy")
    assert "stage 0's 5 timed runs spread 200% of their median (2 to 6 ms" in err


def test_a_quiet_profile_says_nothing(monkeypatch, capsys):
    timed(monkeypatch, [9.0, 2.0, 2.1, 2.0, 1.9, 2.0])
    assert capsys.readouterr().err == ""


def test_the_spread_and_its_limit():
    assert spread([2.0, 2.0, 6.0]) == 2.0 and spread([1.0]) == 0.0
    assert spread([1.0, 1.0 + NOISE_LIMIT, 1.0]) == pytest.approx(NOISE_LIMIT)
    quiet, noisy = [[1.0, 1.1, 1.0]], [[1.0, 1.0, 1.0], [1.0, 3.0, 1.0]]
    assert profile.warn_if_noisy(quiet) == pytest.approx(0.1)
    assert profile.warn_if_noisy(noisy) == 2.0  # the noisiest stage's
