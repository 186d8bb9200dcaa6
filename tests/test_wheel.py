"""The wheel a user installs, tried as a user would: built from the tree, installed into a fresh
virtual environment, used from a directory outside the checkout on a model file of the user's.

The fresh environment holds the wheel (installed by pip, without its dependencies) and, through
a `.pth` line, links to exactly the distributions its base requirements need, taken from this
environment (torch and what torch requires, jinja2, click, safetensors): what `pip install
pipec` would put there, without copying 900 MB of torch per run. `pip check` then says whether
the base requirements hold, and nothing else of this environment (triton, numpy, transformers,
pipec's own checkout) is reachable.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from tests.helpers import checkout_files

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

USER_MODEL = '''
"""A user's own model: a small MLP regressor, nothing of pipec's examples."""
import torch
from torch import nn
from pipec.frontend import ModelSpec


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class Regressor(nn.Module):
    def __init__(self, d: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def factory() -> ModelSpec:
    x, y = torch.randn(4, 16), torch.randn(4, 1)
    return ModelSpec(Regressor(), (x,), y, nn.functional.mse_loss)
'''


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _copy_tree(dest: Path) -> None:
    """The files git would commit (tracked, or new and not ignored), links kept as links."""
    for src in checkout_files(ROOT):
        out = dest / src.relative_to(ROOT)
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            out.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, out)


def _requirements(dist: str, seen: set[str]) -> None:
    """`dist` and what it requires here (markers evaluated, extras left out), recursively."""
    key = re.sub(r"[-_.]+", "-", dist).lower()
    if key in seen:
        return
    seen.add(key)
    for req in metadata.requires(dist) or []:
        name, _, marker = req.partition(";")
        if "extra" in marker or (marker.strip() and not _marker_holds(marker)):
            continue
        _requirements(re.split(r"[<>=!~\[ (]", name.strip(), maxsplit=1)[0], seen)


def _marker_holds(marker: str) -> bool:
    from packaging.markers import Marker

    return Marker(marker).evaluate()


def _link_distributions(names: set[str], into: Path) -> None:
    """Links in `into` to each distribution's top-level files and its metadata folder."""
    into.mkdir()
    for name in names:
        dist = metadata.distribution(name)
        base = Path(str(dist.locate_file("")))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            if (base / top).exists() and not (into / top).exists():
                (into / top).symlink_to(base / top)


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("wheel")
    _copy_tree(tmp / "src")
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    _run([*build, "-w", str(tmp / "dist"), str(tmp / "src")], tmp, _clean_env())
    wheel = next((tmp / "dist").glob("pipec-*.whl"))
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp, _clean_env())
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    _run([*pip, "install", "-q", "--no-deps", "--no-index", str(wheel)], tmp, _clean_env())
    needed: set[str] = set()
    for req in _base_requirements(wheel):
        _requirements(re.split(r"[<>=!~\[ (]", req, maxsplit=1)[0], needed)
    _link_distributions(needed, tmp / "deps")
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "base-requirements.pth").write_text(f"{tmp / 'deps'}\n")
    return {"tmp": tmp, "wheel": wheel, "venv": venv, "python": python}


def _base_requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines that hold here without an extra."""
    with zipfile.ZipFile(wheel) as z:
        text = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    found = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req, _, marker = line.removeprefix("Requires-Dist:").strip().partition(";")
            if "extra" not in marker and (not marker.strip() or _marker_holds(marker)):
                found.append(req.strip())
    return found


def _clean_env() -> dict[str, str]:
    """This environment without the checkout on PYTHONPATH (the tests put it there), where
    pip would find the checkout's own metadata and take pipec as installed."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _user_env(venv: Path) -> dict[str, str]:
    """A user's shell with the fresh venv first on PATH; nothing of the checkout's."""
    return _clean_env() | {
        "PATH": f"{venv / 'bin'}{os.pathsep}/usr/bin:/bin",
        "OMP_NUM_THREADS": "1",
    }


def test_the_wheel_holds_one_import_package_and_only_the_base_requirements(wheel_env):
    names = zipfile.ZipFile(wheel_env["wheel"]).namelist()
    tops = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert tops == {"pipec"}, tops
    assert {"pipec/runtime/main.py", "pipec/codegen/templates/launch.py.j2"} <= set(names)
    base = _base_requirements(wheel_env["wheel"])
    assert base and base[0].startswith("torch"), base
    assert not [r for r in base if re.match(r"(triton|numpy)\b", r)], base


def test_in_a_fresh_venv_only_pipec_is_importable_and_requirements_hold(wheel_env):
    env, python = _user_env(wheel_env["venv"]), str(wheel_env["python"])
    out = wheel_env["tmp"] / "elsewhere"
    out.mkdir(exist_ok=True)
    for name in ("runtime", "passes", "codegen", "triton", "numpy"):
        proc = subprocess.run(
            [python, "-c", f"import {name}"], cwd=out, env=env, capture_output=True, check=False
        )
        assert proc.returncode != 0, f"`import {name}` works in the fresh venv"
    pip = [sys.executable, "-m", "pip", "--python", python, "check"]
    assert "No broken requirements" in _run(pip, out, env).stdout
    version = _run(["pipec", "--version"], out, env).stdout
    assert version.strip() == f"pipec {metadata.version('pipec')}"


def test_a_users_model_compiles_and_trains_from_outside_the_checkout(wheel_env):
    env = _user_env(wheel_env["venv"])
    work = wheel_env["tmp"] / "user"
    work.mkdir()
    (work / "regressor.py").write_text(USER_MODEL)
    compile_cmd = ["pipec", "compile", "regressor.py:factory", "-s", "1f1b", "-p", "2"]
    said = _run([*compile_cmd, "--out", "build"], work, env).stdout
    assert "wrote build/" in said
    launch = (work / "build" / "launch.py").read_text()
    assert "from pipec.runtime" in launch and "sys.path" not in launch
    ran = _run(["pipec", "run", "build", "--steps", "2", "--threads", "1"], work, env)
    said = ran.stdout + ran.stderr
    assert re.search(r"step\s+2/2\s+loss", said), said[-2000:]
    assert "NumPy" not in said  # torch's import warning: pipec does not need numpy
    assert str(ROOT) not in (work / "build" / "plan.json").read_text()
