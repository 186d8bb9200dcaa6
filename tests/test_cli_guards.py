"""Guard rails: every bad input is one line and exit 2, and --out is never half-written,
never the working directory and never a directory that holds something else."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import pipec
from tests.helpers import tree
from tests.test_cli import ROOT, cli_run, compile_to

SHAPE = ("-s", "1f1b", "-p", "4", "-m", "8")


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pipec: error: "), err
    return err


@pytest.mark.parametrize(
    "args, message",
    [
        (["simulate", *SHAPE, "--costs", ""], "--costs is empty"),
        (["simulate", *SHAPE, "--costs", " , "], "--costs is empty"),
        (["simulate", *SHAPE, "--costs", "F=1,F=2"], "--costs gives F twice"),
        (["simulate", *SHAPE, "--mem", ""], "--mem is empty"),
        (["simulate", *SHAPE, "--mem", "F=1,F=2"], "--mem gives F twice"),
        (["simulate", *SHAPE, "--memory-limit", "-3"], "--memory-limit must be a positive"),
        (["simulate", *SHAPE, "--memory-limit", "0"], "--memory-limit must be a positive"),
        (["simulate", *SHAPE, "--memory-limit", "inf"], "--memory-limit must be a positive"),
        (["simulate", *SHAPE, "--memory-limit", "nan"], "--memory-limit must be a positive"),
    ],
)
def test_silently_accepted_inputs_are_refused(args, message, capsys):
    assert cli_run(*args) == 2
    assert message in one_line_error(capsys)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lines", "-5"], "Invalid value for '--lines': -5"),
        (["--width", "0"], "Invalid value for '--width': 0"),
    ],
)
def test_show_refuses_negative_lines_and_narrow_charts(tmp_path, args, message, capsys):
    compile_to(tmp_path / "b")
    capsys.readouterr()
    assert cli_run("show", str(tmp_path / "b"), *args) == 2
    assert message in one_line_error(capsys)


def test_version(capsys):
    assert cli_run("--version") == 0
    assert capsys.readouterr().out == f"pipec {pipec.__version__}\n"


def test_out_help_text(capsys):
    assert cli_run("compile", "--help") == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "-o, --out PATH Build directory to write" in help_text


@pytest.mark.parametrize("out", [".", "..", "/"])
@pytest.mark.parametrize("force", [[], ["--force"]])
def test_out_is_never_the_working_directory_or_above_it(tmp_path, monkeypatch, capsys, out, force):
    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.txt").write_text("keep me")
    monkeypatch.chdir(work)

    def never(*args, **kw):
        raise AssertionError("compiled before checking --out")

    monkeypatch.setattr("pipec.commands.compiling.compile_schedule", never)
    assert cli_run("compile", *SHAPE, "--out", out, *force) == 2
    assert "is the working directory or holds it" in one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]
    assert [p.name for p in work.iterdir()] == ["mine.txt"]


def test_quick_start_after_the_demo(tmp_path, monkeypatch, capsys):
    """`make demo` writes build/demo; compiling to build must not delete it, with or without
    --force, and the message says where to write instead."""
    monkeypatch.chdir(tmp_path)
    compile_to(Path("build/demo"))
    demo = sorted(p.name for p in Path("build/demo").iterdir())
    capsys.readouterr()
    for force in ([], ["--force"]):
        assert cli_run("compile", *SHAPE, "--out", "build", *force) == 2
        err = one_line_error(capsys)
        assert "holds another build, build/demo" in err and "--out build/1f1b" in err
        assert sorted(p.name for p in Path("build/demo").iterdir()) == demo
    compile_to(Path("build/1f1b"))  # the suggestion works


def test_the_tests_leave_the_demo_s_leftovers_alone(tmp_path, monkeypatch, capsys):
    """`make demo` then `make test`: a checkout holding build/demo and build/demo-ckpt (as the
    demo leaves them) changes nothing for the tests' compiles, which write to temporary
    directories: a bad input still gets its own message, not build/'s, and nothing under
    build/ is touched."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(repo)
    compile_to(Path("build/demo"))
    step = Path("build/demo-ckpt/step_000030")
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"demo checkpoint")
    before = tree(Path("build"))
    capsys.readouterr()
    out = tmp_path / "out"
    compile_to(out / "1f1b")
    model = ("examples/gpt.py:tiny", "-s", "1f1b", "-p", "2", "-m", "2")
    assert cli_run("compile", *model, "-o", str(out / "gpt")) == 0
    assert cli_run("compile", *model, "--costs", "F=2", "-o", str(out / "bad")) == 2
    assert "with MODEL give only comm=" in one_line_error(capsys)
    assert cli_run("simulate", *SHAPE, "--json") == 0
    assert tree(Path("build")) == before
    assert sorted(p.name for p in repo.iterdir()) == ["build", "examples"]


def test_force_replaces_only_a_pipec_build(tmp_path, capsys):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    assert cli_run("compile", *SHAPE, "--out", str(notes), "--force") == 2
    assert "holds files that are not a pipec build" in one_line_error(capsys)
    assert (notes / "todo.txt").read_text() == "keep me"
    compile_to(tmp_path / "b")
    compile_to(tmp_path / "b", "--force")  # a build replaces a build


def test_build_directory_mode_follows_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        compile_to(tmp_path / "b")
    finally:
        os.umask(old)
    assert (tmp_path / "b").stat().st_mode & 0o777 == 0o750
    assert (tmp_path / "b/plan.json").stat().st_mode & 0o777 == 0o640


def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(child.stdout)


def interrupted_compile(tmp_path: Path, how: signal.Signals) -> subprocess.CompletedProcess:
    """`python -m pipec compile` sent `how` by itself while it writes its files."""
    code = (
        "import os, signal, sys\n"
        "import pipec.build_dir as b\n"
        f"b._write = lambda *a: os.kill(os.getpid(), signal.{how.name})\n"
        "from pipec.cli import run\n"
        "sys.argv = ['pipec', *sys.argv[1:]]\n"
        "run()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", code, "compile", *SHAPE, "-o", "b"]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, check=False)


def test_sigterm_removes_the_half_written_build(tmp_path):
    done = interrupted_compile(tmp_path, signal.SIGTERM)
    assert done.returncode == 128 + signal.SIGTERM and "pipec: terminated" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_stale_temporaries_of_killed_compiles_are_removed(tmp_path):
    done = interrupted_compile(tmp_path, signal.SIGKILL)
    assert done.returncode == -signal.SIGKILL
    (left,) = tmp_path.iterdir()  # SIGKILL leaves the temporary behind
    assert left.name.startswith(".b.tmp-")
    stale_old = tmp_path / f".b.old-{dead_pid()}-0123abcd"
    live = tmp_path / f".other.tmp-{os.getpid()}-0123abcd"  # a compile still running
    unlike_ours = tmp_path / f".b.tmp-{dead_pid()}-notours"
    for d in (stale_old, live, unlike_ours):
        d.mkdir()
    compile_to(tmp_path / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["b", live.name, unlike_ours.name])


def test_verify_needs_exactly_the_plans_files(tmp_path, capsys):
    compile_to(tmp_path / "b")
    stray = tmp_path / "b/rank_004.pipe"
    stray.write_text((tmp_path / "b/rank_003.pipe").read_text())
    assert cli_run("verify", str(tmp_path / "b")) == 2
    assert "rank_004.pipe: not a file of this build" in one_line_error(capsys)
    stray.unlink()
    (tmp_path / "b/schedule.svg").unlink()
    assert cli_run("verify", str(tmp_path / "b")) == 2
    assert "schedule.svg: missing" in one_line_error(capsys)


def test_verify_resimulates_stats_json(tmp_path, capsys):
    compile_to(tmp_path / "b")
    stats = tmp_path / "b/stats.json"
    stats.write_text(stats.read_text().replace('"makespan": 33.0', '"makespan": 30.0'))
    assert cli_run("verify", str(tmp_path / "b")) == 2
    err = one_line_error(capsys)
    assert "stats.json: makespan is 30.0, but simulating the programs gives 33.0" in err
    assert cli_run("show", str(tmp_path / "b")) == 2
    assert "this build is broken: " in one_line_error(capsys)


def test_a_run_s_measurements_belong_to_the_build(tmp_path):
    compile_to(tmp_path / "b")
    (tmp_path / "b/measured").mkdir()
    assert cli_run("verify", str(tmp_path / "b")) == 0
