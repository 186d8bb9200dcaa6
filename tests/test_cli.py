"""The CLI: outputs, determinism, atomic writes, and one-line errors with exit code 2."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipec.cli import main

ROOT = Path(__file__).resolve().parents[1]


def cli_run(*args: str) -> int:
    try:
        main(list(args))
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def compile_to(out: Path, *extra: str) -> None:
    assert cli_run("compile", "-s", "1f1b", "-p", "4", "-m", "8", "-o", str(out), *extra) == 0


def test_compile_writes_the_build_directory(tmp_path):
    compile_to(tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "b").iterdir())
    assert names == [
        "plan.json",
        "rank_000.pipe",
        "rank_001.pipe",
        "rank_002.pipe",
        "rank_003.pipe",
        "schedule.svg",
        "stats.json",
        "timeline.json",
    ]
    stats = json.loads((tmp_path / "b/stats.json").read_text())
    assert stats["makespan"] == 33 and stats["ranks"][0]["peak_activations"] == 4
    trace = json.loads((tmp_path / "b/timeline.json").read_text())
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == 4 * 8 * 2
    assert (tmp_path / "b/schedule.svg").read_text().count("</title></rect>") == 4 * 8 * 2


def test_identical_input_gives_byte_identical_output(tmp_path):
    compile_to(tmp_path / "a")
    compile_to(tmp_path / "b")
    for f in (tmp_path / "a").iterdir():
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes(), f.name


def test_simulate_json(capsys):
    assert cli_run("simulate", "-s", "1f1b", "-p", "4", "-m", "8", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["makespan"] == 33 and out["bubble"] == pytest.approx(0.2727, abs=1e-4)
    assert {"busy", "span", "peak_activations"} <= set(out["ranks"][0])


def test_show_and_verify(tmp_path, capsys):
    compile_to(tmp_path / "b")
    assert cli_run("verify", str(tmp_path / "b")) == 0
    assert "ok: 4 ranks" in capsys.readouterr().out
    assert cli_run("show", str(tmp_path / "b"), "--width", "66") == 0
    out = capsys.readouterr().out
    assert "rank   3 |......FFXXXX" in out and "SEND_ACT s=0 mb=0 to=1" in out


def test_schedules_lists_families(capsys):
    assert cli_run("schedules") == 0
    out = capsys.readouterr().out
    for name in ("gpipe", "1f1b", "1f1b-r", "interleaved"):
        assert name in out


def test_the_pipec_command_exits_with_the_commands_code_and_its_output_flushed(tmp_path):
    """`python -m pipec` (the console script's `run`) leaves through os._exit: what the
    command printed and wrote must all be there, and its exit code must be the command's."""

    def pipec(*args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "pipec", *args]
        return subprocess.run(
            cmd, check=False, capture_output=True, text=True, env=env, cwd=tmp_path
        )

    ok = pipec("compile", "-s", "1f1b", "-p", "4", "-m", "8", "-o", "b")
    assert ok.returncode == 0 and ok.stdout.startswith("wrote b/: 4 rank programs"), ok
    assert json.loads((tmp_path / "b/stats.json").read_text())["makespan"] == 33
    bad = pipec("compile", "-s", "1f1b", "-p", "4", "-m", "8", "-o", "b")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--force" in bad.stderr
    assert pipec("--help").returncode == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["-s", "nope", "-p", "4", "-m", "8"], "unknown schedule 'nope'; valid schedules: 1f1b"),
        (["-s", "1f1b", "-p", "0", "-m", "8"], "--pp must be at least 1"),
        (["-s", "1f1b", "-p", "4", "-m", "0"], "--microbatches must be at least 1"),
        (["-s", "1f1b", "-p", "4", "-m", "8", "-v", "2"], "--chunks 2 is not allowed"),
        (["-s", "interleaved", "-p", "4", "-m", "8", "-v", "1"], "--chunks must be at least 2"),
        (["-s", "interleaved", "-p", "4", "-m", "6"], "must be a multiple of --pp 4"),
        (["-s", "1f1b", "-p", "4", "-m", "8", "--costs", "F=x"], "--costs: cannot read 'F=x'"),
        (["-s", "1f1b", "-p", "4", "-m", "8", "--costs", "F=-1"], "must not be negative"),
        (["-s", "1f1b", "-p", "4", "-m", "8", "--costs", "F=1:2"], "has 2 values"),
        (["-s", "1f1b", "-m", "8"], "Missing option '--pp'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert cli_run("simulate", *args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_m_defaults_to_four_per_rank_and_says_so(capsys):
    assert cli_run("simulate", "-s", "1f1b", "-p", "3", "--json") == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["m"] == 12
    assert err == "pipec: -m not given: 12 micro-batches (4p)\n"


def test_existing_output_needs_force(tmp_path, capsys):
    compile_to(tmp_path / "b")
    before = (tmp_path / "b/rank_000.pipe").read_text()
    assert cli_run("compile", "-s", "gpipe", "-p", "4", "-m", "8", "-o", str(tmp_path / "b")) == 2
    assert "exists and is not empty; pass --force" in capsys.readouterr().err
    assert (tmp_path / "b/rank_000.pipe").read_text() == before
    compile_to(tmp_path / "b", "--force")


def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    written = []
    real_write = Path.write_text

    def write_then_fail(self, text):
        if len(written) == 2:
            raise OSError("No space left on device")
        written.append(self)
        return real_write(self, text)

    monkeypatch.setattr(Path, "write_text", write_then_fail)
    assert cli_run("compile", "-s", "1f1b", "-p", "4", "-m", "8", "-o", str(tmp_path / "b")) == 2
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda t: t[: len(t) // 2], "not an instruction"),  # truncated mid-line
        (lambda t: t.replace("F s=0 mb=3", "F s=0 mb=x"), "not an instruction"),
        (lambda t: t.replace("version=1", "version=9"), "format version 9"),
        (lambda t: re.sub(r"plan=[0-9a-f]{16}", "plan=" + "0" * 16, t), "header does not match"),
        (lambda t: "", "not a pipec program"),
    ],
)
def test_corrupted_program_is_refused(tmp_path, damage, message, capsys):
    compile_to(tmp_path / "b")
    f = tmp_path / "b/rank_000.pipe"
    f.write_text(damage(f.read_text()))
    for cmd in ("verify", "show"):
        assert cli_run(cmd, str(tmp_path / "b")) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


def test_tampered_program_fails_verification(tmp_path, capsys):
    compile_to(tmp_path / "b")
    f = tmp_path / "b/rank_002.pipe"
    f.write_text(f.read_text().replace("RECV_ACT s=2 mb=4 from=1\n", ""))
    assert cli_run("verify", str(tmp_path / "b")) == 2
    assert "rank 2, instruction" in capsys.readouterr().err


def test_missing_directory(tmp_path, capsys):
    assert cli_run("verify", str(tmp_path / "nowhere")) == 2
    assert "no plan.json here" in capsys.readouterr().err


def test_a_model_build_is_shown_verified_and_exported_from_any_directory(
    tmp_path, monkeypatch, capsys
):
    """The factory is found as `pipec run` finds it (the file recorded at compile time), not
    against the current directory: `show --json` rebuilds the model for its memory prediction."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "b"
    assert (
        cli_run(
            "compile", "examples/gpt.py:tiny", "-s", "1f1b", "-p", "2", "-m", "2", "-o", str(out)
        )
        == 0
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert cli_run("show", str(out), "--json") == 0
    shown = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in shown["ranks"]] == [0, 1]
    assert all(r["predicted_peak_bytes"] > 0 for r in shown["ranks"])
    assert cli_run("verify", str(out)) == 0
    assert cli_run("export", str(out), "--out", "-") == 0
    assert capsys.readouterr().err == ""
