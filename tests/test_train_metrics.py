"""Metrics, evaluation and --config, as launch.py runs them (one torchrun launch, 2 ranks):
metrics.jsonl's figures against their formulas and the plan's FLOPs, the training losses
and the evaluation losses against a plain one-process loop (so evaluating changed nothing),
TensorBoard's event files, the config file with the command line over it; and the options'
refusals, in-process before any rank starts."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch

from pipec.build_dir import emit, load
from pipec.frontend import load_factory
from pipec.model import compile_model
from pipec.runtime.metrics import batch_unit, known_peak_tflops, program_flops
from pipec.runtime.options import parse_launch
from pipec.runtime.torchrun import torchrun
from tests.runtime_launch import said_by_rank_0
from tests.train_factories import CONFIG, copying_data, held_out

ROOT = Path(__file__).resolve().parents[1]
SPEC = f"{ROOT}/tests/train_factories.py:copying_with_eval"
M, STEPS, LR, EVERY, EVAL_BATCHES, PEAK = 4, 4, 3e-3, 2, 2, 0.5
BOARD = importlib.util.find_spec("tensorboard") is not None


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, Path]:
    tmp = tmp_path_factory.mktemp("metrics")
    build = tmp / "build"
    emit(compile_model(SPEC, "1f1b", 2, M), build)
    config = tmp / "run.toml"  # both spellings of a key; --steps on the command line wins
    config.write_text(f"steps = 2\nlr = {LR}\neval-every = {EVERY}\neval_steps = {EVAL_BATCHES}\n")
    board = tmp / "tb"
    args = ["--threads", "1", "--config", str(config), "--steps", str(STEPS)]
    args += ["--peak-tflops", str(PEAK)] + (["--tensorboard", str(board)] if BOARD else [])
    cmd, env = torchrun(build / "launch.py", 2, *args)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return build, proc, board


def records(build: Path) -> list[dict]:
    return [
        json.loads(line) for line in (build / "measured/metrics.jsonl").read_text().splitlines()
    ]


def plain_run() -> tuple[list[float], dict[int, float]]:
    """The plain model, one process: AdamW on the same global batches (mean of the m
    micro-batch losses), and the mean evaluation loss after every EVERY steps."""
    ms = load_factory(SPEC)
    opt = torch.optim.AdamW(ms.model.parameters(), lr=LR, weight_decay=0.0)  # launch.py's default
    rows = M * CONFIG.micro_batch
    losses, evals = [], {}
    for step, ((x,), y) in enumerate(copying_data(rows, 0), start=1):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xi, yi in zip(x.chunk(M), y.chunk(M)):
            loss = ms.loss_fn(ms.model(xi), yi)
            (loss / M).backward()
            total += loss.item()
        opt.step()
        losses.append(total / M)
        if step % EVERY == 0:
            ms.model.eval()
            with torch.no_grad():
                batches = [b for _, b in zip(range(EVAL_BATCHES), held_out(rows, 0))]
                mb = [
                    ms.loss_fn(ms.model(xi), yi).item()
                    for (x,), y in batches
                    for xi, yi in zip(x.chunk(M), y.chunk(M))
                ]
            ms.model.train()
            evals[step] = sum(mb) / len(mb)
        if step == STEPS:
            return losses, evals
    raise AssertionError("unreachable")


@pytest.mark.slow
def test_metrics_follow_their_formulas(run):
    build, proc, _ = run
    got = records(build)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    b = load(build)
    flops = [program_flops(b.plan, b.compiled.layout.stage_chunk, p) for p in b.compiled.programs]
    stages = b.plan["model"]["stages"]  # every (stage, mb)'s F + B + W, split over the ranks
    assert sum(flops) == pytest.approx(M * sum(sum(s["flops"].values()) for s in stages))
    tokens = M * CONFIG.micro_batch * CONFIG.seq_len
    for r in got:
        t = r["step_s"]
        assert t == max(r["wall_s_per_rank"]) > 0
        assert r["tokens_per_step"] == tokens
        assert r["tokens_per_s"] == pytest.approx(tokens / t)
        assert r["flops_per_rank"] == flops
        assert r["tflops_per_rank"] == pytest.approx([f / t / 1e12 for f in flops])
        assert r["mfu"] == pytest.approx(sum(flops) / (t * 2 * PEAK * 1e12))
        assert r["lr"] == LR and r["grad_norm"] > 0 and r["peak_tflops"] == PEAK
        assert len(r["real_peak_bytes_per_rank"]) == 2 and min(r["real_peak_bytes_per_rank"]) > 0
        assert ("eval_loss" in r) == (r["step"] % EVERY == 0)
    lines = re.findall(
        r"step +(\d+)/4 +loss (\S+) +lr (\S+) +gnorm \S+ +\S+ \w?tok/s .* MFU (\S+)%", proc.stdout
    )
    assert [int(s) for s, *_ in lines] == list(range(1, STEPS + 1))
    assert float(lines[0][1]) == pytest.approx(got[0]["loss"], abs=1e-4)
    assert f"eval after step {EVERY}: loss " in proc.stdout


@pytest.mark.slow
def test_evaluation_equals_the_plain_model_and_leaves_training_unchanged(run):
    build, _, _ = run
    got = records(build)
    losses, evals = plain_run()
    # The plain loop never evaluates inside training: equal losses mean evaluating changed
    # nothing of the trajectory (weights, optimizer, data position, random numbers).
    assert [r["loss"] for r in got] == pytest.approx(losses, rel=1e-5)
    seen = {r["step"]: r["eval_loss"] for r in got if "eval_loss" in r}
    assert seen == pytest.approx(evals, rel=1e-5)
    assert all(r["eval_batches"] == EVAL_BATCHES for r in got if "eval_loss" in r)


@pytest.mark.slow
def test_the_config_file_with_the_command_line_over_it(run):
    build, proc, _ = run
    config = json.loads((build / "measured/config.json").read_text())
    assert config["steps"] == STEPS  # the command line's, over the file's 2
    assert (config["lr"], config["eval_every"], config["eval_steps"]) == (LR, EVERY, EVAL_BATCHES)
    (line,) = [s for s in proc.stdout.splitlines() if s.startswith("config: ")]
    assert f"steps={STEPS}" in line and f"eval_every={EVERY}" in line


@pytest.mark.slow
@pytest.mark.skipif(not BOARD, reason="tensorboard is not installed (pip install tensorboard)")
def test_tensorboard_events_hold_the_metrics(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    build, _, board = run
    events = EventAccumulator(str(board))
    events.Reload()
    got = records(build)
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in got]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in got], rel=1e-6)
    assert [e.step for e in events.Scalars("eval/loss")] == list(range(EVERY, STEPS + 1, EVERY))
    assert {"train/lr", "throughput/tokens_per_s", "throughput/mfu"} <= set(
        events.Tags()["scalars"]
    )


def _refusal(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        parse_launch(list(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_config_keys_and_their_refusals(tmp_path, capsys):
    f = tmp_path / "c.toml"
    f.write_text('steps = 7\nsave-every = 2\ncheck_grads = false\nno_verify = true\nsave = "ck"\n')
    config = parse_launch(["--config", str(f), "--save-every", "3"])
    ck = config.checkpoint
    assert (config.training.steps, ck.save_every, config.run.no_verify, str(ck.save)) == (
        7,
        3,
        True,
        "ck",
    )
    f.write_text("steps = 7\nmax_nrom = 1.0\n")
    err = _refusal(capsys, "--config", str(f))
    assert "unknown key 'max_nrom'; valid keys: " in err and "eval_every" in err
    f.write_text("steps = [\n")
    assert "not TOML" in _refusal(capsys, "--config", str(f))
    assert "cannot read it" in _refusal(capsys, "--config", str(tmp_path / "none.toml"))
    f.write_text("no_verify = 1\n")
    assert "no_verify is a switch" in _refusal(capsys, "--config", str(f))
    f.write_text('steps = "many"\n')
    assert "invalid int value: 'many'" in _refusal(capsys, "--config", str(f))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--eval-every", "-1"], "--eval-every must be 0"),
        (["--eval-steps", "0"], "--eval-steps at least 1"),
        (["--peak-tflops", "-3"], "--peak-tflops must be positive"),
    ],
)
def test_bad_values_are_refused_in_one_line(argv, message, capsys):
    assert message in _refusal(capsys, *argv)


def test_tensorboard_without_the_package_says_how_to_install_it(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name)
    )
    err = _refusal(capsys, "--tensorboard", "tb")
    assert "pip install 'pipec[tensorboard]'" in err


def test_eval_every_without_eval_data_is_refused_before_any_communication(
    tmp_path, monkeypatch, capsys
):
    build = tmp_path / "b"
    emit(compile_model(f"{ROOT}/tests/train_factories.py:copying", "1f1b", 2, 2), build)
    err = said_by_rank_0(build, monkeypatch, capsys, "--eval-every", "5", world=2)
    assert "--eval-every 5: the ModelSpec of" in err and "has no eval_data" in err


def test_peaks_units_and_flops():
    assert known_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert known_peak_tflops("NVIDIA H100 PCIe", "fp32") == 51.0
    assert known_peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert known_peak_tflops("NVIDIA L40S", "bf16") == 362.0
    assert known_peak_tflops("NVIDIA A10G", "bf16") is None  # not the A10's figures
    ms = load_factory(SPEC)
    assert batch_unit(ms) == ("tokens", CONFIG.micro_batch * CONFIG.seq_len)
    assert (
        batch_unit(ms.__class__(ms.model, (torch.randn(3, 5),), ms.example_target, ms.loss_fn))[0]
        == "samples"
    )
    assert not math.isnan(known_peak_tflops("NVIDIA H200", "fp32"))
