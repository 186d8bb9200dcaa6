"""Checkpoints a hostile tester hands pipec, and directories that mix runs, in-process (no
torchrun): a tensor of the right name and shape but another dtype, an optimizer state of
another size, a manifest whose header or steps contradict the files or each other, malformed
manifests (deep nesting, numbers out of range) are refused in one line with exit 2 before any
rank joins, or skipped for an older checkpoint with a notice; `--save` never mixes a directory
with another model's, build's or run's checkpoints; a rollback starts a branch whose own
checkpoints are the newest; one run of a build at a time.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from pipec import checkpoint, run_lock
from pipec.build_dir import emit, load
from pipec.checkpoint_files import sha256
from pipec.checkpoint_lineage import ASIDE, Lineage
from pipec.cli import main as pipec_main
from pipec.frontend import load_factory
from pipec.ir import PipecError
from pipec.model import compile_model
from pipec.runtime.checkpoint_hooks import branch, claim
from pipec.runtime.options import parse_launch
from pipec.runtime.preflight import preflight
from tests.helpers import tree
from tests.runtime_launch import said_by_rank_0

ROOT = Path(__file__).resolve().parents[1]
DATA = f"{ROOT}/tests/train_factories.py:copying"
PARAM = "ln_f.weight"  # a parameter of the model, shape (32,), tied to nothing


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hostile-ck") / "build"
    emit(compile_model(DATA, "1f1b", 2, 4), out)
    return out


def lineage_of(directory: Path, **changed: str) -> Lineage:
    """A run of the build in `directory` (its model's fingerprint, plan hash), fields `changed`."""
    built = load(directory)
    return Lineage(**Lineage.new(built.plan, built.plan_hash, None).record() | changed)


def saved(directory: Path, step: int, lineage: Lineage | None = None, optim: bool = False) -> Path:
    """A real checkpoint of the build's model at `step` (with AdamW's state after one step)."""
    model = load_factory(DATA).model
    optimizer = None
    if optim:
        optimizer = torch.optim.AdamW(model.parameters())
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
    state = checkpoint.state_dict([model], optimizer)
    return checkpoint.save(directory, step, state, lineage)


def tampered(ck: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """`change` the tensors of checkpoint `ck` and make its manifest match the file (sizes,
    sha256, shapes, dtypes), as someone forging a checkpoint would."""
    data = ck / "rank_00000.safetensors"
    tensors = load_file(data)
    change(tensors)
    save_file(tensors, data)
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["files"][data.name] = {"bytes": data.stat().st_size, "sha256": sha256(data)}
    manifest["tensors"] = {
        key: {"file": data.name, "shape": list(t.shape), "dtype": str(t.dtype)[6:]}
        for key, t in tensors.items()
    }
    (ck / "manifest.json").write_text(json.dumps(manifest))


def refusal(build: Path, monkeypatch, capsys, *args: str) -> str:
    return said_by_rank_0(build, monkeypatch, capsys, *args, world=2)


# -- contents against the model -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.bool, torch.int8])
def test_a_tensor_of_another_dtype_is_refused(build, tmp_path, monkeypatch, capsys, dtype):
    ck = saved(tmp_path, 2)

    def recast(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"model.{PARAM}"] = (tensors[f"model.{PARAM}"] * 1000).to(dtype)

    tampered(ck, recast)
    name = str(dtype).removeprefix("torch.")
    said = f"model.{PARAM} is {name} (32,) in this checkpoint, float32 (32,) in the model"
    assert said in refusal(build, monkeypatch, capsys, "--resume", str(tmp_path))
    with pytest.raises(PipecError, match=said.replace("(", r"\(").replace(")", r"\)")):
        checkpoint.load_full(tmp_path, load_factory(DATA).model)


@pytest.mark.parametrize(
    "state, shape, model",
    [
        ("exp_avg", (64,), (32,)),
        ("exp_avg", (16,), (32,)),
        ("exp_avg", (), (32,)),
        ("step", (32,), ()),
    ],
)
def test_an_optimizer_state_of_another_size_is_refused(
    build, tmp_path, monkeypatch, capsys, state, shape, model
):
    """Twice or half its parameter's size, one number (which fused AdamW's kernel overruns), or
    a step count the parameter's size."""
    ck = saved(tmp_path, 2, optim=True)
    key = f"optim.{PARAM}.{state}"

    def resize(tensors: dict[str, torch.Tensor]) -> None:
        tensors[key] = tensors[key].reshape(-1).repeat(64)[: math.prod(shape)].reshape(shape)

    tampered(ck, resize)
    said = f"{key} is float32 {shape} in this checkpoint, float32 {model} in the model"
    assert said in refusal(build, monkeypatch, capsys, "--resume", str(tmp_path))


def test_a_header_that_contradicts_the_manifest_is_refused(build, tmp_path, monkeypatch, capsys):
    ck = saved(tmp_path, 2)
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["tensors"][f"model.{PARAM}"]["dtype"] = "float16"
    (ck / "manifest.json").write_text(json.dumps(manifest))
    said = f"model.{PARAM} is float32 (32,) in the file, float16 (32,) in the manifest"
    assert said in refusal(build, monkeypatch, capsys, "--resume", str(ck))


# -- malformed manifests --------------------------------------------------------------------------


def _manifest(ck: Path) -> dict:
    return json.loads((ck / "manifest.json").read_text())


MALFORMED = {
    "100,000 deep": (lambda ck: "[" * 100_000 + "]" * 100_000, "nested deeper than a manifest"),
    "1e999": (
        lambda ck: json.dumps(_manifest(ck)).replace('"step": 2,', '"step": 1e999,'),
        "1e999: not a finite number",
    ),
    "NaN": (
        lambda ck: json.dumps(_manifest(ck) | {"step": float("nan")}),
        "NaN: not a finite number",
    ),
    "step -5": (
        lambda ck: json.dumps(_manifest(ck) | {"step": -5}),
        "step is -5, not a count of 0 or more",
    ),
    "two steps": (
        lambda ck: json.dumps(_manifest(ck) | {"scalars": {"step": 7}}),
        "step 2 but scalars' step 7",
    ),
    "step of another directory": (
        lambda ck: json.dumps(_manifest(ck) | {"step": 7, "scalars": {"step": 7}}),
        "step 7 in a directory named step_000002",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_newest_manifest_is_skipped_for_the_older(build, tmp_path, capsys, case):
    older, newest = saved(tmp_path, 1), saved(tmp_path, 2)
    text, reason = MALFORMED[case]
    (newest / "manifest.json").write_text(text(newest))
    config = parse_launch(["--resume", str(tmp_path), "--steps", "5"])
    run = preflight(build, config, world=2, local_world=2)
    err = capsys.readouterr().err
    assert run.resume == older and run.start == 1
    assert err.startswith(f"pipec runtime: notice: skipping {newest.name}: {newest}/manifest.json")
    assert reason in err and err.count("\n") == 1 and "Traceback" not in err


# -- lineages: what --save may be given ---------------------------------------------------------


@pytest.mark.parametrize(
    "whose, said",
    [
        ({"model": "0" * 16}, "holds checkpoints of another model (step_000005)"),
        ({"build": "0" * 16}, "holds checkpoints of another build (step_000005: plan 00"),
        ({}, "already holds checkpoints (newest step_000005); continue them with --resume"),
    ],
)
def test_save_refuses_a_directory_of_another_lineage(
    build, tmp_path, monkeypatch, capsys, whose, said
):
    """`--resume A --save Y`, Y holding checkpoints of another model, another build, or
    another run of this one: exit 2 before any rank joins, from launch.py and from `pipec run`
    before torchrun starts; Y unchanged."""
    a, y = saved(tmp_path / "A", 3), tmp_path / "Y"
    saved(y, 5, lineage_of(build, **whose))
    before = tree(y)
    args = ["--resume", str(a), "--save", str(y), "--steps", "9"]
    assert said in refusal(build, monkeypatch, capsys, *args)
    with pytest.raises(SystemExit) as e:
        pipec_main(["run", str(build), *args])
    assert e.value.code == 2 and said in capsys.readouterr().err
    assert tree(y) == before


def test_a_rollback_starts_a_branch_whose_checkpoints_are_newest(build, tmp_path, capsys):
    """Z holds steps 5 and 10; `--resume Z/step_000005 --save Z`: step 10 is moved aside (said,
    kept), the run's own steps 6 to 9 are saved and pruned to its two newest, step 5 (an earlier
    run's) stays, and `--resume Z` continues from step 9."""
    z = tmp_path / "Z"
    first = lineage_of(build)
    saved(z, 5, first)
    saved(z, 10, first)
    args = ["--resume", str(z / "step_000005"), "--save", str(z), "--steps", "9"]
    run = preflight(build, parse_launch(args), world=2, local_world=2)
    assert run.resume == z / "step_000005" and run.abandoned == (z / "step_000010",)
    branch(run)
    aside = z / f"{ASIDE}{run.lineage.id}"
    said = capsys.readouterr().err
    assert said == (
        f"pipec runtime: notice: resuming from step 5, older than step_000010 in {z}: a new "
        f"branch; step_000010 moved to {aside} (kept, never resumed from again)\n"
    )
    for step in range(6, 10):
        saved(z, step, run.lineage)
    assert [p.name for p in checkpoint.checkpoints(z)] == [f"step_00000{k}" for k in (5, 8, 9)]
    assert checkpoint.saved_step(aside / "step_000010") == 10  # kept whole
    again = preflight(
        build, parse_launch(["--resume", str(z), "--save", str(z), "--steps", "12"]), 2, 2
    )
    assert again.resume == z / "step_000009" and not again.abandoned
    assert checkpoint.manifest(again.resume)["run"]["resumed_from"] == str(z / "step_000005")


# -- one run at a time per build and per --save directory -------------------------------------


@pytest.mark.parametrize("held", ["build", "save"])
def test_a_second_run_is_refused(build, tmp_path, monkeypatch, capsys, held):
    """The lock of the build, or of the --save directory (by a run of another build), held as
    by a run's rank 0: `pipec run` refuses before torchrun starts, and rank 0 of a launch after
    joining, every rank exiting 2; released, the run may start."""
    save = tmp_path / "ckpt"
    fds = run_lock.hold(build) if held == "build" else run_lock.hold(tmp_path / "other", save)
    said = {
        "build": f"{build} is being run already (pid {os.getpid()} on ",
        "save": f"--save {save} is being saved into by another run (pid {os.getpid()} on ",
    }[held]
    args = ["--save", str(save), "--steps", "3"]
    try:
        with pytest.raises(SystemExit) as e:
            pipec_main(["run", str(build), *args])
        assert e.value.code == 2 and said in capsys.readouterr().err
        store = dist.FileStore(str(tmp_path / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        run = preflight(build, parse_launch(args), world=2, local_world=2)
        with pytest.raises(SystemExit) as e:
            claim(run, 0, torch.device("cpu"))
        assert e.value.code == 2 and not dist.is_initialized()
        err = capsys.readouterr().err
        assert err.startswith(f"pipec runtime: {said}") and err.count("\n") == 1
    finally:
        for fd in fds:
            os.close(fd)
    run_lock.check_free(build, save)
