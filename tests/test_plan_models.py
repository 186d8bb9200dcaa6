"""`pipec plan` on models whose blocks are not one tensor in, one tensor out.

Hugging Face's Llama is captured with torch.export, which bakes the example's batch size into
the graph: each profiled size is captured anew. A decoder whose blocks pass the token ids and
a bool mask beside the residual stream has three values at every boundary, two of them not
differentiable; its message is the floating one. Both plan end to end from the CLI, at a size
other than their factory's (the example resized).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import cli_run

from pipec.plan.saved import load

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--runs", "1", "--peak-tflops", "1", "--threads", "1", "--time-budget", "60"]
FAST += ["--no-calibration-run"]  # the op times are not what these tests check

pytestmark = pytest.mark.slow


def plan(spec: str, tmp: Path, capsys) -> tuple[dict, object]:  # type: ignore[no-untyped-def]
    """Plan `spec` at micro-batch sizes 2 and 4 on 2 ranks; its JSON and saved profile."""
    argv = ["plan", spec, "--pp", "2", "--global-batch", "8", "--mbs", "2,4"]
    argv += ["--memory-per-device", "1GiB", "--schedules", "1f1b,zb-v", *FAST]
    code = cli_run(*argv, "--save-profile", str(tmp / "p.json"), "--json")
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out), load(tmp / "p.json").profile


def test_hf_llama_plans_at_sizes_its_export_did_not_see(tmp_path, capsys):
    out, profile = plan(f"{ROOT}/examples/hf_llama.py:tiny", tmp_path, capsys)
    assert profile.sizes == (2, 4) and not profile.factory_sized  # the example is 2
    for pt in profile.points:  # the residual stream, (mbs, 32, 64) fp32, after each block
        assert pt.message_bytes[1:] == (pt.mbs * 32 * 64 * 4,) * 3
        assert pt.host_bytes and pt.w_held_bytes  # a CPU profile: the meter's terms
    assert {r["mbs"] for r in out["candidates"]} == {2, 4}
    for row in out["candidates"]:
        assert row["peak_bytes"] == max(r["total"] for r in row["memory"])
        assert [r["rank"] for r in row["memory"]] == [0, 1]


def test_a_boundary_of_ids_mask_and_activation_plans(tmp_path, capsys):
    out, profile = plan(f"{ROOT}/tests/frontend_models/stock.py:masked", tmp_path, capsys)
    assert profile.sizes == (2, 4)
    for pt in profile.points:
        ids, keep, x = pt.mbs * 16 * 8, pt.mbs * 16, pt.mbs * 16 * 32 * 4
        assert pt.input_bytes[1:] == (ids + keep + x,) * 3
        assert pt.message_bytes[1:] == (x,) * 3  # what a cut sends and gets a gradient for
    rows = out["candidates"]
    assert rows and all(r["memory"][0]["buffers"] > 0 for r in rows)
