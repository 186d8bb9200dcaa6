"""`--device`: `pipec compile MODEL --profile` and `pipec plan` profile on the device the build
will run on; a device this machine lacks is one line on stderr and exit code 2, before any
output is written."""

import json
from pathlib import Path

import pytest
import torch

from pipec.frontend import build_model_plan, load_factory
from pipec.frontend.profile import on_device
from pipec.ir import PipecError
from tests.test_cli import cli_run

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples/gpt.py:tiny")
COMPILE = ("compile", GPT, "-s", "1f1b", "-p", "2", "-m", "2")
PLAN = ("plan", GPT, "--pp", "2", "-B", "4", "--memory-per-device", "1GiB", "--mbs", "1")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def one_error_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@no_cuda
@pytest.mark.parametrize("command", ["compile", "plan"])
def test_cuda_without_a_gpu_is_one_line_and_exit_2(command, tmp_path, capsys):
    out = tmp_path / "build"
    args = (*COMPILE, "--profile", "-o", str(out)) if command == "compile" else PLAN
    assert cli_run(*args, "--device", "cuda") == 2
    err = one_error_line(capsys)
    assert err.startswith("pipec: error: --device cuda: CUDA is not available on this machine")
    assert not out.exists()


@pytest.mark.parametrize("name", ["tpu", "gpu0", "meta"])
def test_a_name_that_is_no_profiling_device_lists_the_valid_ones(name, capsys):
    assert cli_run(*PLAN, "--device", name) == 2
    assert f"--device {name}: pipec profiles on cpu, cuda or cuda:N" in one_error_line(capsys)


def test_device_without_profile_says_to_add_it(tmp_path, capsys):
    assert cli_run(*COMPILE, "--device", "cpu", "-o", str(tmp_path / "b")) == 2
    assert "--device says where --profile times the stages; add --profile" in one_error_line(capsys)


def test_compile_profiles_on_the_named_device(tmp_path):
    out = tmp_path / "build"
    assert cli_run(*COMPILE, "--profile", "--device", "cpu", "-o", str(out)) == 0
    cost = json.loads((out / "plan.json").read_text())["model"]["cost"]
    assert (cost["source"], cost["device"]) == ("profile", "cpu")


def test_plan_hands_the_device_to_the_profiler(monkeypatch, capsys):
    """`pipec plan --device` reaches the profiler, which moves the model before measuring (the
    stand-in stops there: the move itself is `on_device`, tested through compile)."""
    from pipec.plan import profile_mbs

    def stop(ms, name):
        raise PipecError(f"profiling {type(ms.model).__name__} on {name}")

    monkeypatch.setattr(profile_mbs, "on_device", stop)
    assert cli_run(*PLAN, "--device", "cuda:3") == 2
    assert "profiling GPT on cuda:3" in one_error_line(capsys)


def test_a_meta_model_cannot_be_moved():
    ms = load_factory(str(ROOT / "examples/gpt.py:gpt3_96b"))
    with pytest.raises(PipecError, match=r"--device cpu: the factory builds its model on the meta"):
        on_device(ms, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profiling_on_cuda_records_the_gpu():
    plan = build_model_plan(GPT, 2, profile=True, device="cuda", runs=2, progress=False)
    assert plan.device.startswith("cuda") and plan.cost_source == "profile"
    assert all(s.seconds.F > 0 for s in plan.stages)
