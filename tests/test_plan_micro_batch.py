"""A factory may take the micro-batch size: `factory(micro_batch_size=B)`.

`load_factory` passes it where the factory takes it and checks the size either way; `pipec
compile --micro-batch-size` records it in plan.json's model, from which every rebuild of the
stages asks the factory again; a factory that cannot give the size is one line naming it.
"""

import json
import time
from pathlib import Path

import pytest
import torch
from test_cli import cli_run

from pipec.frontend import FrontendError, build_stages, load_factory
from pipec.frontend.spec import takes_micro_batch_size

ROOT = Path(__file__).resolve().parents[1]
FACTORIES = f"{ROOT}/tests/plan_factories.py"
GPT = f"{ROOT}/examples/gpt.py:tiny"


def batch(spec) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    return spec.example_inputs[0].shape[0], spec.example_target.shape[0]


@pytest.mark.parametrize("name", ["sized", "by_kwargs"])
def test_a_factory_that_takes_the_keyword_gives_the_size_asked(name):
    spec = f"{FACTORIES}:{name}"
    assert takes_micro_batch_size(spec)
    assert batch(load_factory(spec, micro_batch_size=5)) == (5, 5)
    assert batch(load_factory(spec)) == (2, 2)  # not asked: its own size


def test_the_size_leaves_the_weights_alone():
    a, b = load_factory(GPT), load_factory(GPT, micro_batch_size=6)
    assert batch(a) == (2, 2) and batch(b) == (6, 6)
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_factory_without_the_keyword_gives_its_own_size_only():
    spec = f"{FACTORIES}:fixed"
    assert not takes_micro_batch_size(spec)
    assert batch(load_factory(spec, micro_batch_size=2)) == (2, 2)
    with pytest.raises(FrontendError) as e:
        load_factory(spec, micro_batch_size=4)
    message = str(e.value)
    assert "\n" not in message
    assert "gives micro-batches of 2 samples and takes no micro_batch_size keyword" in message
    assert "micro-batches of 4 are needed" in message


def test_a_factory_that_ignores_the_keyword_is_refused():
    with pytest.raises(FrontendError, match="was asked for micro_batch_size=4 but gives"):
        load_factory(f"{FACTORIES}:ignores", micro_batch_size=4)


def test_compile_records_the_size_and_every_rebuild_asks_for_it(tmp_path):
    out = tmp_path / "b"
    argv = ["compile", GPT, "-s", "1f1b", "-p", "2", "-m", "2", "--micro-batch-size", "3"]
    assert cli_run(*argv, "-o", str(out)) == 0
    model = json.loads((out / "plan.json").read_text())["model"]
    assert model["micro_batch_size"] == 3
    assert model["stages"][0]["inputs"][0]["shape"] == [3, 32]
    assert model["stages"][1]["inputs"][0]["shape"] == [3, 32, 64]
    # The runtime's rebuild (build_stages) asks the factory for the recorded size.
    first, second = build_stages(None, model, [0, 1])
    x = load_factory(GPT, micro_batch_size=3).example_inputs[0]
    assert second(first(x)).shape == (3, 32, 128)


def test_compile_without_the_option_keeps_the_plan_as_it_was(tmp_path):
    out = tmp_path / "b"
    assert cli_run("compile", GPT, "-s", "1f1b", "-p", "2", "-m", "2", "-o", str(out)) == 0
    model = json.loads((out / "plan.json").read_text())["model"]
    assert "micro_batch_size" not in model and model["stages"][0]["inputs"][0]["shape"][0] == 2


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--micro-batch-size", "4"], "micro-batches of 4 are needed"),
        (["--micro-batch-size", "0"], "'--micro-batch-size': 0 is not in the range x>=1"),
    ],
)
def test_compile_a_size_the_factory_cannot_give_is_one_line(tmp_path, capsys, extra, message):
    out = tmp_path / "b"
    argv = ["compile", f"{FACTORIES}:fixed", "-s", "1f1b", "-p", "2", "-m", "2", *extra]
    assert cli_run(*argv, "-o", str(out)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not out.exists()


def test_the_size_needs_a_model(capsys, tmp_path):
    argv = ["compile", "-s", "1f1b", "-p", "2", "-m", "2", "--micro-batch-size", "4"]
    assert cli_run(*argv, "-o", str(tmp_path / "b")) == 2
    assert "need a MODEL" in capsys.readouterr().err


def test_plan_out_of_a_row_the_factory_cannot_give_is_one_line(tmp_path, capsys, monkeypatch):
    # Without the keyword the plan profiles mbs 4 from the example (repeated), but cannot
    # build it: the error names the size the row needs, and nothing is written to --out.
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "build"
    code = cli_run(
        "plan", f"{FACTORIES}:fixed", "--pp", "2", "--global-batch", "8", "--mbs", "4",
        "--memory-per-device", "1GiB", "--schedules", "1f1b", "--strategies", "plain",
        "--runs", "1", "--peak-tflops", "0.1", "--threads", "1", "--out", str(out),
        "--no-calibration-run",
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 2
    errors = [line for line in captured.err.splitlines() if line.startswith("pipec: error:")]
    assert errors == captured.err.splitlines()[-1:]  # one line; above it, the progress bar
    assert "takes no micro_batch_size keyword; micro-batches of 4 are needed" in errors[0]
    assert "(the example resized)" in captured.out
    assert not out.exists()


def test_the_sweep_stops_before_a_size_that_would_overrun_the_time_budget():
    from pipec.plan.profile_mbs import profile_model

    profile = profile_model(GPT, [1, 2, 4], time_budget=0, runs=1, peak_flops=1e12, progress=False)
    assert [pt.mbs for pt in profile.points] == [1]
    assert profile.stopped == "time budget (0 s) before mbs 2"


def test_the_one_time_extras_do_not_count_as_time_that_grows_with_the_size(monkeypatch):
    """The first size also measures autograd's host records (once per sweep), made slow here:
    extrapolating that from size 1 to size 2 as if it doubled would stop the sweep; the rule
    counts only the timing runs as growing, and the capture once."""
    from pipec.plan import profile_mbs

    extras, real = profile_mbs._extras, time.perf_counter
    slept = [0.0]  # a virtual clock: real time / 1000, plus the 6 s the extras "take"

    def slow_extras(*args):  # type: ignore[no-untyped-def]
        slept[0] += 6
        return extras(*args)

    monkeypatch.setattr(profile_mbs, "_extras", slow_extras)
    monkeypatch.setattr(profile_mbs.time, "perf_counter", lambda: real() / 1000 + slept[0])
    profile = profile_mbs.profile_model(
        GPT, [1, 2], time_budget=12.5, runs=1, peak_flops=1e12, progress=False
    )
    assert [pt.mbs for pt in profile.points] == [1, 2], profile.stopped
