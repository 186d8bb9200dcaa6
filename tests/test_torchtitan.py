"""`pipec export --torchtitan`: the settings beside the CSV, and the real torchtitan taking them.

The fast tests read what the export writes and prints for v-half and interleaved builds of
examples/llama.py:tiny at p=2 (torchtitan 0.3's overrides, 0.2's TOML) and its one-line
refusals. The slow test runs ONE torchrun launch of 2 gloo ranks (tests/torchtitan_worker.py):
torchtitan's ConfigManager parses each build's overrides as written, and torchtitan's
`pipeline_llm` builds its own Llama3 (8 layers) from them and steps once; its losses and every
parameter's gradient equal a plain loop's. It is skipped only where torchtitan is not
installed (the Makefile's venv installs it).
"""

import importlib.util
import sys
from importlib import metadata
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pipec's own dependency before 3.11
    import tomli as tomllib

from pipec.build_dir import emit, load
from pipec.cli import main as pipec_main
from pipec.frontend import load_factory
from pipec.interop import export_torch_csv
from pipec.ir import PipecError
from pipec.model import compile_model
from pipec.torch_runtime import outer_modules
from pipec.torchtitan import NAMES, placement, torchtitan_names
from tests.helpers import run
from tests.runtime_launch import run_cases

P, M, LLAMA = 2, 4, "examples/llama.py:tiny"
WORKER = Path(__file__).resolve().parent / "torchtitan_worker.py"
LAYERS = [f"layers.{i}" for i in range(8)]


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Path]:
    """v-half (a V, split backward) and interleaved (looped) builds of LLAMA."""
    tmp = tmp_path_factory.mktemp("torchtitan")
    for fam in ("v-half", "interleaved"):
        emit(compile_model(LLAMA, fam, P, M), tmp / fam)
    return {fam: tmp / fam for fam in ("v-half", "interleaved")}


def export(build: Path, csv: Path, capsys, *args: str) -> tuple[list[str], str]:
    """The printed overrides (the lines after the first) and the whole printed text."""
    pipec_main(["export", str(build), "--out", str(csv), "--torchtitan", *args])
    printed = capsys.readouterr().out
    return printed.splitlines()[1:], printed


def flags(lines: list[str]) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in lines}


def test_v_half_overrides_are_written_beside_the_csv_as_printed(builds, tmp_path, capsys):
    csv = tmp_path / "vhalf.csv"
    lines, printed = export(builds["v-half"], csv, capsys, "--torchtitan-version", "0.3")
    assert csv.read_bytes().decode() == export_torch_csv(builds["v-half"], comms=False)
    args = (tmp_path / "vhalf.torchtitan.args").read_text().splitlines()
    assert lines[: len(args)] == args and lines[len(args)].startswith("warning: ")
    got = flags(args)
    assert got.pop("--parallelism.pipeline_parallel_schedule") == ["ZBVZeroBubble"]  # a V
    assert got.pop("--parallelism.pipeline_parallel_schedule_csv") == [str(csv.resolve())]
    assert got.pop("--parallelism.pipeline_parallel_degree") == [str(P)]
    size = int(got.pop("--parallelism.pipeline_parallel_microbatch_size")[0])
    assert got.pop("--training.local_batch_size") == [str(M * size)]
    parts = [part.split(",") for part in got.pop("--parallelism.module_fqns_per_model_part")]
    blocks = load(builds["v-half"]).plan["model"]["partition"]["blocks_per_stage"]
    assert [len([n for n in part if n.startswith("layers.")]) for part in parts] == blocks
    assert [n for part in parts for n in part] == ["tok_embeddings", *LAYERS, "norm", "lm_head"]
    # a split backward: FSDP keeps the parameters after forward, checkpointing is full, last
    assert got.pop("--parallelism.fsdp_reshard_after_forward") == ["never"]
    assert got == {"--training.disable_cuda_graphs": [], "activation_checkpoint:full": []}
    assert args[-1] == "activation_checkpoint:full"
    assert "selective" in printed.splitlines()[-1]


def test_interleaved_overrides_leave_fsdp_and_checkpointing_alone(builds, tmp_path, capsys):
    lines, printed = export(builds["interleaved"], tmp_path / "i.csv", capsys)
    got = flags(lines)
    assert got["--parallelism.pipeline_parallel_schedule"] == ["Interleaved1F1B"]
    assert "--parallelism.fsdp_reshard_after_forward" not in got and "warning" not in printed
    assert not any(line.startswith("activation_checkpoint") for line in lines)


def test_torchtitan_0_2_gets_a_toml_with_its_head_name(builds, tmp_path, capsys):
    export(builds["v-half"], tmp_path / "v.csv", capsys, "--torchtitan-version", "0.2.2")
    config = tomllib.loads((tmp_path / "v.torchtitan.toml").read_text())
    parts = config["parallelism"]["module_fqns_per_model_part"]
    assert [n for part in parts for n in part] == ["tok_embeddings", *LAYERS, "norm", "output"]
    assert config["training"] == {"local_batch_size": M * 2}  # 0.2 has no CUDA graph setting
    assert config["activation_checkpoint"] == {"mode": "full"}
    assert not (tmp_path / "v.torchtitan.args").exists()


def test_the_version_is_the_installed_ones(builds, tmp_path, capsys, monkeypatch):
    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    _, printed = export(builds["interleaved"], tmp_path / "a.csv", capsys)
    assert "torchtitan is not installed here: the newest form" in printed
    monkeypatch.setattr(metadata, "version", lambda name: "0.2.1")
    export(builds["interleaved"], tmp_path / "b.csv", capsys)
    assert (tmp_path / "b.torchtitan.toml").is_file()


def test_names_map_from_hugging_face_llama_and_on_request():
    model = load_factory("examples/hf_llama.py:tiny").model
    before, after = outer_modules(model, "model.layers")
    names = [*before, "model.layers.0", *after]
    assert torchtitan_names(names, NAMES, "lm_head", "M") == [
        "tok_embeddings", "layers.0", "norm", "lm_head"
    ]  # fmt: skip
    gpt2 = {"transformer.h": "layers", "transformer.ln_f": "norm", "lm_head": "head"}
    assert torchtitan_names(["transformer.h.3", "transformer.ln_f", "lm_head"], gpt2, "output",
                            "M") == ["layers.3", "norm", "output"]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--torchtitan-names", "output=out"], "maps to 'out', which torchtitan's decoder lacks"),
        (["--torchtitan-names", "norm"], "give OURS=THEIRS pairs"),
        (["--torchtitan-names", "blocks=x,norm=norm"], "'blocks.0' maps to 'x.0'"),
        (["--torchtitan-names", "output=norm"], "several of Llama's modules map to norm"),
        (["--torchtitan-version", "0.1"], "pipec writes settings for torchtitan 0.2, 0.3"),
    ],
)
def test_bad_names_and_versions_are_refused_and_write_nothing(builds, tmp_path, capsys, args, said):
    with pytest.raises(SystemExit) as e:
        pipec_main(["export", str(builds["interleaved"]), "--out", str(tmp_path / "x.csv"),
                    "--torchtitan", *args])  # fmt: skip
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and said in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_name_without_a_rule_is_refused():
    with pytest.raises(PipecError) as e:
        torchtitan_names(["wte"], NAMES, "lm_head", "GPT")
    assert "GPT's module 'wte' has no torchtitan name; map it with --torchtitan-names wte=" in (
        str(e.value)
    )


def test_a_csv_path_the_shell_would_split_is_refused(builds, tmp_path, capsys):
    with pytest.raises(SystemExit):
        pipec_main(["export", str(builds["interleaved"]), "--out", str(tmp_path / "a b.csv"),
                    "--torchtitan"])  # fmt: skip
    assert "without spaces" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("fam", "style"), [("1f1b", "loop"), ("interleaved", "loop")])
def test_torchtitan_placement_of_looped_builds(fam, style):
    assert placement(run(fam, 4, 8).compiled.layout) == style


def test_export_torchtitan_refusals_write_nothing(tmp_path, capsys):
    emit(run("chimera", 4, 8), tmp_path / "b")
    for args in (["--out", str(tmp_path / "x.csv")], ["--out", "-"]):
        with pytest.raises(SystemExit) as e:
            pipec_main(["export", str(tmp_path / "b"), "--torchtitan", *args])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed (the Makefile's venv has it: make .venv/.installed)",
)
def test_torchtitan_runs_the_overrides_as_a_plain_loop(builds, tmp_path, capsys):
    cases = []
    for fam, build in builds.items():
        export(build, tmp_path / f"{fam}.csv", capsys, "--torchtitan-version", "0.3")
        args = tmp_path / f"{fam}.torchtitan.args"
        cases.append({"name": fam, "build": str(build), "args": str(args)})
    ranks = run_cases(cases, P, tmp_path, timeout=600, script=WORKER).results
    for case in cases:
        words = flags(Path(case["args"]).read_text().splitlines())
        got = [r[case["name"]] for r in ranks]
        for r in got:  # every field pipec set, as torchtitan parsed it
            assert set(r["parsed"]) == {flag[2:] for flag in words if flag.startswith("--")}
            for flag, parsed in r["parsed"].items():
                value = words[f"--{flag}"]
                if flag == "parallelism.module_fqns_per_model_part":
                    assert parsed == [part.split(",") for part in value]
                else:
                    assert [str(parsed)] == value or (parsed is True and value == []), flag
        full = case["name"] == "v-half"
        assert all(r["activation_checkpoint"] == ("FullAC" if full else "SelectiveAC") + ".Config"
                   for r in got)  # fmt: skip
        last = next(r for r in got if r["losses"])
        assert len(last["losses"]) == M
        for loss, plain in zip(last["losses"], last["plain_losses"], strict=True):
            assert abs(loss - plain) <= 1e-5 * abs(plain)
        grads = {name: d for r in got for name, d in r["grad_differences"].items()}
        assert len(grads) == got[0]["parameters"] and max(grads.values()) <= 1e-5, grads
