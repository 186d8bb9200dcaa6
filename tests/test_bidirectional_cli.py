"""Bidirectional schedules from the CLI: bad shapes are one line and exit 2; stats show weights."""

import json

import pytest

from tests.test_cli import cli_run


@pytest.mark.parametrize(
    "args, message",
    [
        (["-s", "chimera", "-p", "3", "-m", "6"], "chimera: --pp 3 must be even"),
        (["-s", "bitpipe", "-p", "5", "-m", "10"], "bitpipe: --pp 5 must be even"),
        (["-s", "dualpipe", "-p", "3", "-m", "6"], "dualpipe: --pp 3 must be even"),
        (["-s", "chimera", "-p", "4", "-m", "7"], "--microbatches 7 must be even"),
        (["-s", "bitpipe", "-p", "4", "-m", "6"], "--microbatches 6 must be a multiple of --pp 4"),
        (["-s", "dualpipe", "-p", "4", "-m", "9"], "--microbatches 9 must be even and at least 2"),
        (["-s", "dualpipe", "-p", "4", "-m", "6"], "--microbatches 6 must be even and at least 2"),
        (["-s", "dualpipev", "-p", "4", "-m", "7"], "--microbatches 7 must be at least 2·pp = 8"),
        (["-s", "bitpipe", "-p", "4", "-m", "8", "-v", "1"], "--chunks 1 is not allowed"),
        (
            ["-s", "chimera", "-p", "4", "-m", "8", "--costs", "allreduce=x"],
            "cannot read 'allreduce=x'",
        ),
    ],
)
def test_bad_shape_is_one_line_and_exit_2(args, message, capsys):
    assert cli_run("simulate", *args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_stats_report_weights_and_sync(tmp_path, capsys):
    out = tmp_path / "b"
    args = ["-s", "chimera", "-p", "4", "-m", "8", "--costs", "allreduce=1", "-o", str(out)]
    assert cli_run("compile", *args) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert [r["params"] for r in stats["ranks"]] == [2, 2, 2, 2]
    assert [r["sync"] for r in stats["ranks"]] == [2, 2, 2, 2]
    assert cli_run("verify", str(out)) == 0
    assert "ok: 4 ranks" in capsys.readouterr().out
