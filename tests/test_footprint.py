"""A compile too large for the machine is refused from its shape, before anything is built; a
long one reports progress; `pipec plan` refuses an infeasible --pp before profiling."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from pipec import footprint, progress
from pipec.ir import PipecError
from tests.helpers import ticking
from tests.test_cli import ROOT, cli_run


def test_a_shape_that_would_not_fit_is_refused_before_building(monkeypatch, capsys, tmp_path):
    """p=100 000 grew without bound (24 GB after minutes); now one line, nothing built."""
    monkeypatch.setattr(footprint, "available_bytes", lambda: 24 * 2**30)

    def never(*args, **kw):
        raise AssertionError("the compile started")

    monkeypatch.setattr("pipec.commands.compiling.compile_schedule", never)
    assert cli_run("simulate", "-s", "1f1b", "-p", "100000", "-m", "8") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "p=100000 m=8 v=1 would need about 160 GiB to compile" in err
    assert "more than the 24 GiB free here" in err
    out = ("-o", str(tmp_path / "b"))
    assert (
        cli_run("compile", "-s", "interleaved", "-p", "20000", "-m", "20000", "-v", "2", *out) == 2
    )
    assert "v=2 would need about" in capsys.readouterr().err


# The peak resident size from /proc (ru_maxrss would carry pytest's over the exec).
PEAK_RSS = """
import re, sys
from pipec.compile import compile_schedule
compile_schedule(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
status = open("/proc/self/status").read()
print(int(re.search(r"VmHWM:\\s+(\\d+) kB", status)[1]) * 1024)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule, p, m, v",
    [("1f1b", 32, 512, 1), ("interleaved", 16, 512, 2), ("1f1b", 3000, 8, 1)],
)
def test_the_estimate_is_close_to_the_measured_peak(schedule, p, m, v):
    """The estimate is within a tenth below and a half above the measured peak, both where
    ops dominate and where the simulator's p^2 tables do (5-20 % above when measured)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", PEAK_RSS, schedule, str(p), str(m), str(v)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    measured = json.loads(out)
    estimate = footprint.footprint(p, m, v).bytes
    assert 0.9 <= estimate / measured <= 1.5, (estimate, measured)


def test_a_long_compile_reports_progress(monkeypatch, capsys):
    monkeypatch.setenv("PIPEC_PROGRESS", "1")
    monkeypatch.setattr(progress, "FIRST_S", 0.01)
    monkeypatch.setattr(progress, "EVERY_S", 0.02)
    assert cli_run("simulate", "-s", "1f1b", "-p", "32", "-m", "512", "--json") == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines, "no progress line"
    for line in lines:
        assert line.startswith("pipec: compiling 1f1b p=32 m=512 v=1 (16384 stage ops, about ")
        assert " s so far" in line
    assert json.loads(captured.out)["makespan"] > 0  # the output is the command's alone


def test_progress_goes_to_stderr_that_is_not_a_terminal(monkeypatch, capsys):
    """A log or a pipe (capsys is neither a terminal) gets the lines a terminal gets."""
    monkeypatch.setenv("PIPEC_PROGRESS", "1")
    ticking(monkeypatch, "pipec.commands.compiling.compile_schedule")
    assert not sys.stderr.isatty()
    assert cli_run("simulate", "-s", "1f1b", "-p", "4", "-m", "8", "--json") == 0
    captured = capsys.readouterr()
    assert re.fullmatch(r"pipec: compiling 1f1b p=4 m=8 v=1 \(.*\): \d+ s so far\n", captured.err)
    assert json.loads(captured.out)["makespan"] == 33


def test_a_model_compile_names_the_model(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PIPEC_PROGRESS", "1")
    ticking(monkeypatch, "pipec.commands.compiling.compile_model")
    model = f"{ROOT}/examples/gpt.py:tiny"
    assert cli_run("compile", model, "-s", "1f1b", "-p", "2", "-m", "2", "-o", str(tmp_path)) == 0
    first = capsys.readouterr().err.splitlines()[0]
    assert re.fullmatch(rf"pipec: compiling {model} with 1f1b p=2 m=2 v=1: \d+ s so far", first)


def test_plan_says_what_it_is_doing(monkeypatch, capsys):
    def refuse(*args, **kw):
        raise PipecError("stopped here")

    monkeypatch.setenv("PIPEC_PROGRESS", "1")
    ticking(monkeypatch, "pipec.plan.profile_mbs.profile_model", refuse)
    argv = ["plan", "examples/gpt.py:tiny", "--pp", "2", "-B", "8", "--memory-per-device", "1GiB"]
    assert cli_run(*argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"pipec: planning examples/gpt.py:tiny for p=2: \d+ s so far", lines[0])
    assert lines[1:] == ["pipec: error: stopped here"]


def test_progress_is_off_with_pipec_progress_0(monkeypatch, capsys):
    def never(*args):
        raise AssertionError("a progress timer started")

    monkeypatch.setenv("PIPEC_PROGRESS", "0")
    monkeypatch.setattr(signal, "setitimer", never)
    assert cli_run("simulate", "-s", "1f1b", "-p", "4", "-m", "8", "--json") == 0
    assert capsys.readouterr().err == ""


def test_progress_names_the_outermost_step():
    def frame_in(module: str, inner):
        """A function that calls `inner` from a frame of `module`."""
        code = compile("def call():\n    return inner()\n", module, "exec")
        namespace = {"__name__": module, "inner": inner}
        eval(code, namespace)
        return namespace["call"]

    here = frame_in("pipec.passes.simulate", lambda: sys._getframe())
    assert progress.step_of(here()) == "simulating"
    writing = frame_in("pipec.build_dir", here)
    assert progress.step_of(writing()) == "writing the files"
    assert progress.step_of(sys._getframe()) == ""


def test_plan_refuses_more_stages_than_blocks_before_profiling(tmp_path):
    """One line, nothing else on stderr: no profiling started (its progress bar would show).
    Run as a command: the frontend's progress bar keeps the stderr of the test that first
    imports it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    spec = f"{ROOT}/examples/gpt.py:tiny"
    args = ["plan", spec, "--pp", "16", "-B", "8", "--memory-per-device", "1GiB"]
    done = subprocess.run(
        [sys.executable, "-m", "pipec", *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "has 8 blocks and --pp 16 needs at least one per stage; use --pp 8 or fewer" in (
        done.stderr
    )
