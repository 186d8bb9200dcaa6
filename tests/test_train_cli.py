"""launch.py as a user meets it: --save/--resume/--check-grads end to end (few torchrun launches,
2 ranks where possible), `pipec run`'s last line, the one-line refusals before any
communication, a build run from another directory, and a save killed mid-write."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from pipec import checkpoint
from pipec.build_dir import check_build, emit, load
from pipec.cli import main as pipec_main
from pipec.frontend import load_factory
from pipec.ir import PipecError
from pipec.model import compile_model
from pipec.provenance import resolve
from pipec.runtime.config import SECTIONS
from pipec.runtime.options import launch_parser, parse_launch
from pipec.runtime.torchrun import _Condense, torchrun
from tests.helpers import forbid_torchrun, ticking
from tests.runtime_launch import refused, said_by_rank_0

ROOT = Path(__file__).resolve().parents[1]
DATA = f"{ROOT}/tests/train_factories.py:copying"
GPT = f"{ROOT}/examples/gpt.py:tiny"


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "build"
    emit(compile_model(DATA, "1f1b", 2, 4), out)
    return out


def launch(build: Path, *args: str, nproc: int = 2, cwd: Path | None = None):
    cmd, env = torchrun(build / "launch.py", nproc, "--threads", "1", *args)
    return subprocess.run(
        cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )


def pipec_run(build: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipec", "run", str(build), "--threads", "1", *args]
    env = torchrun(build / "launch.py", 1)[1]
    return subprocess.run(
        cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )


def step_losses(stdout: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"step +(\d+)/\d+ +loss (\S+)", stdout)}


@pytest.mark.slow
def test_save_resume_and_check_grads_from_another_directory(build, tmp_path):
    """Run from a directory where no relative path of the build works: the factory is found,
    checkpoints are written every 2 steps and at the end, a resumed run continues at step 5
    (its data position too: the losses of an uninterrupted run), and --check-grads after
    resuming compares the loaded weights' gradients."""
    ck = tmp_path / "ck"
    first = launch(build, "--steps", "4", "--save", str(ck), "--save-every", "2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert [p.name for p in checkpoint.checkpoints(ck)] == ["step_000002", "step_000004"]
    assert f"saved {ck / 'step_000004'}" in first.stdout
    resumed = launch(build, "--steps", "6", "--resume", str(ck), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert sorted(step_losses(resumed.stdout)) == [5, 6]
    whole = launch(build, "--steps", "6", cwd=tmp_path)
    expected = step_losses(whole.stdout)
    for step, loss in step_losses(first.stdout + resumed.stdout).items():
        assert loss == pytest.approx(expected[step], abs=1e-4)  # printed to 4 decimals
    check = launch(build, "--check-grads", "--resume", str(ck), cwd=tmp_path)
    assert check.returncode == 0, check.stderr[-2000:]
    assert "check-grads: step 5, 4 micro-batches" in check.stdout
    assert (
        len(re.findall(r"stage +\d \(rank \d\): \d+ tensors, max \|diff\| \S+ +ok", check.stdout))
        == 2
    )
    assert "check-grads: ok, every stage matches" in check.stdout


@pytest.mark.slow
def test_check_grads_fails_on_a_broken_program(tmp_path):
    """A data-parallel build whose rank 1 no longer all-reduces its stage's gradients: the
    verifier refuses it, and run anyway (--no-verify) each copy applies its own half's
    gradients to stage 1 (and, through the head tied to it, to stage 0's embedding):
    --check-grads names both stages, `pipec run` repeats that line last and exits 1."""
    broken = tmp_path / "broken"
    emit(compile_model(DATA, "1f1b", 2, 2, dp=2), broken)
    program = broken / "rank_001.pipe"
    text = program.read_text()
    assert "ALLREDUCE_GRADS s=1" in text
    program.write_text(re.sub(r"ALLREDUCE_GRADS s=1\n", "", text))
    with pytest.raises(PipecError, match="rank 1: stage 1 has no ALLREDUCE_GRADS"):
        check_build(load(broken))
    run = pipec_run(broken, "--no-verify", "--check-grads", cwd=tmp_path)
    assert run.returncode == 1, run.stderr[-3000:]
    assert re.search(r"stage +0 \(rank 0\).* MISMATCH wte.weight: Mismatched elements", run.stdout)
    assert re.search(r"stage +1 \(rank 1\).* MISMATCH blocks\.\d\.", run.stdout)
    last = run.stderr.strip().splitlines()[-1]
    assert (
        last == "pipec run: check-grads failed: stages 0, 1 differ from the plain model's gradients"
    )


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_pipec_run_says_last_why_nothing_ran(build, tmp_path):
    run = pipec_run(build, "--backend", "nccl", cwd=tmp_path)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr and "ChildFailedError" not in run.stderr
    assert re.search(r"^torchrun: rank \d failed first, then rank \d$", run.stderr, re.MULTILINE)
    assert run.stderr.strip().splitlines()[-1] == (
        "pipec run: --backend nccl needs CUDA, and torch sees no GPU here; use gloo"
    )


TORCHRUN_REPORT = """Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in f
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n\
============================================================
build/launch.py FAILED
------------------------------------------------------------
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 2)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 3 (local_rank: 3)
  exitcode  : 2 (pid: 1)
============================================================
"""
RANK_TRACEBACK = """Traceback (most recent call last):
  File "build/launch.py", line 9, in <module>
    main()
ZeroDivisionError: division by zero
"""


def condensed(text: str, said: bool) -> str:
    condense = _Condense()
    return "".join(condense(line, said) for line in text.splitlines(True)) + condense.rest()


def test_pipec_run_condenses_torchruns_report_once_a_rank_said_why():
    """After a rank's `pipec runtime:` line, torchrun's traceback and table become one line;
    a rank's own traceback, and torchrun's report when no rank said anything, pass whole."""
    said = "pipec runtime: bad input\n"
    assert condensed(said + TORCHRUN_REPORT, said=True) == (
        said + "torchrun: rank 3 failed first, then rank 1\n"
    )
    assert condensed(TORCHRUN_REPORT, said=False) == TORCHRUN_REPORT
    assert condensed(RANK_TRACEBACK + TORCHRUN_REPORT, said=True) == (
        RANK_TRACEBACK + "torchrun: rank 3 failed first, then rank 1\n"
    )
    cut = 'Traceback (most recent call last):\n  File "x.py", line 1\n'
    assert condensed(cut, said=True) == cut


# -- one line, exit 2, before any communication ------------------------------------------------


def test_pipec_run_refuses_eval_without_eval_data_before_starting(build, monkeypatch, capsys):
    """The plan records whether the factory has eval_data, so `pipec run` says it before any
    rank starts (a rank would find it too, after torchrun started)."""
    forbid_torchrun(monkeypatch)
    with pytest.raises(SystemExit) as run:
        pipec_main(["run", str(build), "--eval-every", "2"])
    err = capsys.readouterr().err
    assert run.value.code == 2 and err.count("\n") == 1, err
    assert "--eval-every 2: the ModelSpec of" in err and "has no eval_data" in err


def test_an_empty_path_turns_its_option_off(tmp_path):
    """`--save ""` cancels a config file's save (it wrote into the working directory)."""
    config = tmp_path / "run.toml"
    config.write_text('save = "ck"\ntensorboard = "tb"\nresume = "ck"\n')
    argv = ["--config", str(config), "--save", "", "--tensorboard", "", "--resume", ""]
    config = parse_launch(argv)
    assert (config.checkpoint.save, config.metrics.tensorboard, config.checkpoint.resume) == (
        None,
        None,
        None,
    )
    assert parse_launch(["--config", ""]).checkpoint.save is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_nccl_without_cuda(build, monkeypatch, capsys):
    err = said_by_rank_0(build, monkeypatch, capsys, "--backend", "nccl")
    assert err == "pipec runtime: --backend nccl needs CUDA, and torch sees no GPU here; use gloo\n"


def test_rank_0_says_what_its_start_up_is_doing(build, monkeypatch, capsys):
    """A start-up that takes long (checking the build, rebuilding the stages) is said on
    stderr by rank 0, a line every few seconds (one timer tick here)."""

    def stop(*args):
        raise PipecError("stopped after one tick")

    monkeypatch.setenv("PIPEC_PROGRESS", "1")
    ticking(monkeypatch, "pipec.runtime.preflight.check_runnable", stop)
    err = refused(build, monkeypatch, capsys).splitlines()
    assert re.fullmatch(r"pipec: rank 0 of 4 starting: \d+ s so far", err[0])
    assert err[1:] == ["pipec runtime: stopped after one tick"]


def test_an_unverifiable_build(build, tmp_path, monkeypatch, capsys):
    """Rank 1's first forward moved above the receive of its input: gloo would run it (the
    runtime waits for the input at the forward), `pipec verify` refuses it, and so does launch."""
    bad = tmp_path / "bad"
    shutil.copytree(build, bad)
    lines = (bad / "rank_001.pipe").read_text().splitlines(keepends=True)
    k = next(i for i, line in enumerate(lines) if line.startswith("RECV_ACT"))
    lines[k], lines[k + 1] = lines[k + 1], lines[k]
    (bad / "rank_001.pipe").write_text("".join(lines))
    err = said_by_rank_0(bad, monkeypatch, capsys)
    assert f"{bad} fails verification: rank 1" in err and "--no-verify skips this check" in err


def _own_factory(tmp_path: Path) -> tuple[Path, Path]:
    """A build compiled from a copy of examples/gpt.py, so that the test may move or edit it."""
    model = tmp_path / "model" / "gpt_copy.py"
    model.parent.mkdir()
    shutil.copy(ROOT / "examples" / "gpt.py", model)
    out = tmp_path / "own"
    emit(compile_model(f"{model}:tiny", "1f1b", 4, 4), out)
    for name, module in list(sys.modules.items()):  # a run is a new process: it imports anew
        if getattr(module, "__file__", None) == str(model):
            del sys.modules[name]
    return model, out


def test_a_moved_factory_is_named_with_its_remedy(tmp_path, monkeypatch, capsys):
    model, out = _own_factory(tmp_path)
    model.rename(tmp_path / "gpt_moved.py")
    err = said_by_rank_0(out, monkeypatch, capsys)
    assert err == (
        f"pipec runtime: {out}: the model's factory file {model} is gone (compiled as "
        f"{model}:tiny); pass --model NEW/PATH/gpt_copy.py:tiny to launch.py, or recompile\n"
    )


def test_a_factory_is_found_from_anywhere_or_where_it_was_named(tmp_path, monkeypatch):
    """The recorded absolute path from any directory; once moved, the spec as written still
    works from where it was written if the file there has the recorded hash; --model wins."""
    model, out = _own_factory(tmp_path)
    plan = __import__("json").loads((out / "plan.json").read_text())["model"]
    monkeypatch.chdir("/")
    assert resolve(plan, None, out) == f"{model}:tiny"
    relative = dict(plan, spec="model/gpt_copy.py:tiny")
    moved = tmp_path / "elsewhere"
    shutil.copytree(model.parent, moved / "model")
    model.unlink()
    monkeypatch.chdir(moved)
    assert resolve(relative, None, out) == f"{moved / 'model' / 'gpt_copy.py'}:tiny"
    (moved / "model" / "gpt_copy.py").write_text("# edited\n")
    with pytest.raises(PipecError, match="is gone"):
        resolve(relative, None, out)
    assert resolve(relative, "pkg.mod:tiny", out) == "pkg.mod:tiny"


def test_a_changed_model_is_refused(tmp_path, monkeypatch, capsys):
    model, out = _own_factory(tmp_path)
    text = model.read_text()
    model.write_text(
        text.replace(
            "TINY = GPTConfig(vocab_size=128,",
            "TINY = GPTConfig(vocab_size=96,",
        )
    )
    err = said_by_rank_0(out, monkeypatch, capsys)  # the file is not the plan's
    assert f"{model}: the model's factory changed since" in err
    # Run as it is now, on purpose: the model it builds is not the plan's either.
    err = said_by_rank_0(out, monkeypatch, capsys, "--model", f"{model}:tiny")
    assert re.fullmatch(
        rf"pipec runtime: {re.escape(str(model))}:tiny no longer matches the plan: its state_dict "
        r"has \d+ tensors \(fingerprint \w+\), the plan's model \d+ \(\w+\); the model changed "
        r"since compiling: recompile\n",
        err,
    )


def test_checkpoint_refusals(build, tmp_path, monkeypatch, capsys):
    refusal = partial(said_by_rank_0, build, monkeypatch, capsys, world=2)
    err = refusal("--resume", str(tmp_path / "none"))
    assert "no checkpoint here" in err and "--save" in err
    other = load_factory(GPT).model  # another model's checkpoint
    checkpoint.save(tmp_path / "gpt", 1, checkpoint.state_dict([other], None))
    err = refusal("--resume", str(tmp_path / "gpt"))
    assert "is float32 (128, 64) in this checkpoint, float32 (32, 32) in the model" in err
    err = refusal("--save", str(tmp_path / "gpt"))
    assert "already holds checkpoints (newest step_000001); continue them with --resume" in err


# -- atomic saves -------------------------------------------------------------------------------


def _killed_save(directory: Path, model: torch.nn.Module, where: str) -> None:
    """In a child process, save step 9 of `model` and die by SIGKILL at `where`."""
    pid = os.fork()
    if pid == 0:

        def die(*args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            os.kill(os.getpid(), signal.SIGKILL)

        if where == "mid-file":  # the tensor file half written
            real = checkpoint._write_safetensors

            def half(path, tensors) -> None:  # type: ignore[no-untyped-def]
                real(path, tensors)
                os.truncate(path, os.path.getsize(path) // 2)
                die()

            checkpoint._write_safetensors = half
        elif where == "before the manifest":  # every data file written, the manifest not yet
            checkpoint._write_manifest = die
        else:  # the checkpoint complete in its partial directory, not yet renamed
            Path.rename = die
        checkpoint.save(directory, 9, checkpoint.state_dict([model], None))
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


@pytest.mark.parametrize("where", ["mid-file", "before the manifest", "before the rename"])
def test_a_save_killed_mid_write_leaves_the_last_checkpoint(tmp_path, where):
    spec = load_factory(GPT)
    checkpoint.save(tmp_path, 3, checkpoint.state_dict([spec.model], None))
    saved = {k: v.clone() for k, v in spec.model.state_dict().items()}
    with torch.no_grad():
        for p in spec.model.parameters():
            p.add_(1.0)
    _killed_save(tmp_path, spec.model, where)
    assert (tmp_path / ".step_000009.partial").is_dir()  # the killed save's files
    fresh = load_factory(GPT, seed=1).model
    assert checkpoint.load_full(tmp_path, fresh) == 3
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, saved[name]), name
    checkpoint.save(tmp_path, 9, checkpoint.state_dict([spec.model], None))  # a later save
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000009"]


def test_every_launch_option_is_one_field_of_one_config_section():
    """runtime/options.py builds the config by field name: an option no section holds would be
    lost, a field no option fills would fail every launch."""
    dests = [a.dest for a in launch_parser()._actions if a.dest != "help"]
    held = [f.name for section in SECTIONS.values() for f in dataclasses.fields(section)]
    assert sorted(dests) == sorted(held)
