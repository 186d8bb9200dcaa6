"""Inputs a hostile tester hands pipec: crafted checkpoints and plans run no code (a marker file
is never created), damaged checkpoints are named in one line before training, a stopped run
leaves nothing behind and keeps its last checkpoint, and every bad command line is one line
with exit 2 before any work (and before any rank starts). A NaN loss stopping the run in one
line, exit 3, is tests/test_train_step.py's non-finite guard test.

Three torchrun launches in all: a 2-rank `pipec run` stopped by SIGTERM, and its checkpoint
resumed into a build of another p (one rank); a 2-rank `pipec run` rolling back to an older
checkpoint (a new branch), listening on loopback alone, refusing a second run of its build, then
killed by SIGKILL to its process group: nothing of it runs on. tests/test_hostile_checkpoints.py
holds the crafted checkpoints and mixed directories.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from pipec import checkpoint
from pipec.build_dir import emit, load, os_error
from pipec.checkpoint_files import sha256
from pipec.checkpoint_lineage import Lineage
from pipec.cli import main
from pipec.compile import plan_hash
from pipec.frontend import load_factory
from pipec.ir import PipecError
from pipec.model import compile_model
from pipec.runtime.torchrun import _descendants, torchrun
from tests.runtime_launch import said_by_rank_0

ROOT = Path(__file__).resolve().parents[1]
DATA = f"{ROOT}/tests/train_factories.py:copying"


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hostile") / "build"
    emit(compile_model(DATA, "1f1b", 2, 4), out)
    return out


def refused(capsys, *argv: str) -> str:
    """`pipec ARGV` in-process: exit 2 and one line on stderr, which is returned."""
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.count("\n") == 1 and err.startswith("pipec: error: "), err
    assert "Traceback" not in err and ".tmp-" not in err
    return err


class Marker:
    """A file that code smuggled into an input would create."""

    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "MARKER"

    def code(self) -> str:
        return f"open({str(self.path)!r}, 'w').close()"

    def __bool__(self) -> bool:
        return self.path.exists()


class _Smuggle:
    """Unpickling it creates the marker."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (exec, (self.code,))


def saved(directory: Path, step: int = 1, lineage: Lineage | None = None) -> Path:
    """A real checkpoint of the build's model at `step` (of the run `lineage`)."""
    model = load_factory(DATA).model
    return checkpoint.save(directory, step, checkpoint.state_dict([model], None), lineage)


# -- checkpoints ----------------------------------------------------------------------------------


def test_a_pickled_checkpoint_runs_nothing(build, tmp_path, monkeypatch, capsys):
    marker = Marker(tmp_path)
    old = tmp_path / "ck" / "step_000001"
    old.mkdir(parents=True)
    (old / ".metadata").write_bytes(pickle.dumps(_Smuggle(marker.code())))
    err = said_by_rank_0(build, monkeypatch, capsys, "--resume", str(tmp_path / "ck"), world=2)
    assert "old torch.distributed.checkpoint format" in err and not marker
    with pytest.raises(PipecError, match="pickle pipec no longer reads"):
        checkpoint.load_full(old, load_factory(DATA).model)
    # A pickle where a tensor file should be, its manifest entry made to match: not loaded.
    ck = saved(tmp_path / "ck2")
    data = next(ck.glob("*.safetensors"))
    data.write_bytes(pickle.dumps(_Smuggle(marker.code())))
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["files"][data.name] = {
        "bytes": data.stat().st_size,
        "sha256": sha256(data),
    }
    (ck / "manifest.json").write_text(json.dumps(manifest))
    err = said_by_rank_0(build, monkeypatch, capsys, "--resume", str(ck), world=2)
    assert f"{data}: not a safetensors file" in err and not marker


@pytest.mark.parametrize("damage", ["overwritten", "truncated", "garbage manifest"])
def test_a_damaged_checkpoint_is_named_before_training(
    build, tmp_path, monkeypatch, capsys, damage
):
    older, newest = saved(tmp_path, 1), saved(tmp_path, 2)
    data = next(newest.glob("*.safetensors"))
    if damage == "overwritten":
        with open(data, "r+b") as f:
            f.seek(data.stat().st_size // 2)
            f.write(os.urandom(4096)[: data.stat().st_size // 2])
        named = f"{data}: its sha256 differs from the manifest's"
    elif damage == "truncated":
        os.truncate(data, data.stat().st_size // 2)
        named = f"{data}: {data.stat().st_size} bytes, the manifest says"
    else:
        (newest / "manifest.json").write_bytes(os.urandom(64))
        named = f"{newest / 'manifest.json'}: not a pipec checkpoint manifest"
    refusal = partial(said_by_rank_0, build, monkeypatch, capsys, world=2)
    assert named in refusal("--resume", str(newest))  # this one, explicitly: refused
    # The newest, damaged, is skipped for the one before it, with a notice.
    found, skipped = checkpoint.newest_intact(tmp_path)
    assert found == older and len(skipped) == 1
    assert skipped[0].startswith(f"skipping {newest.name}: {named}")
    shutil.rmtree(older)
    assert named in refusal("--resume", str(tmp_path))  # none intact: the newest's defect


def test_a_save_killed_while_writing_leaves_the_last_checkpoint(tmp_path):
    """SIGKILL from outside while a child writes a checkpoint of 64 MiB: step 1 stays whole,
    the killed save is never read and its leftovers go at the next save."""
    saved(tmp_path, 1)
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path)], env=torchrun(Path("x"), 1)[1]
    )
    partial_dir = tmp_path / ".step_000002.partial"
    while child.poll() is None and not list(partial_dir.glob("rank_*.safetensors")):
        time.sleep(0.001)
    child.kill()
    child.wait()
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] in (
        ["step_000001"],
        ["step_000001", "step_000002"],  # the write outran the kill: then it is complete
    )
    for ck in checkpoint.checkpoints(tmp_path):
        checkpoint.verify(ck)
    saved(tmp_path, 3)
    assert not list(tmp_path.glob(".*"))


_WRITER = """
import sys, torch
from pipec import checkpoint
from pipec.checkpoint_files import sha256
state = {f"model.w{i}": torch.randn(1 << 20) for i in range(16)}
checkpoint.save(sys.argv[1], 2, state)
"""


# -- a run stopped by SIGTERM, resumed into another p ---------------------------------------------


@pytest.mark.slow
def test_sigterm_stops_every_rank_and_keeps_the_last_checkpoint(build, tmp_path):
    ck, log = tmp_path / "ck", tmp_path / "stderr"
    cmd = [sys.executable, "-m", "pipec", "run", str(build), "--threads", "1", "--steps", "1000"]
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [*cmd, "--save", str(ck)],
            env=torchrun(build / "launch.py", 1)[1],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    tree: set[int] = set()
    for line in proc.stdout:
        tree |= set(_descendants(proc.pid))
        if re.match(r"step +1/", line):
            break
    tree |= set(_descendants(proc.pid))
    assert len(tree) >= 3  # torchrun and its two ranks
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (proc.poll() is None or _alive(tree)):
        time.sleep(0.1)
    assert proc.poll() is not None and not _alive(tree), "processes left behind after 10 s"
    err = log.read_text()
    last = err.strip().splitlines()[-1]
    stop = re.fullmatch(
        r"pipec run: stopped by SIGTERM after step (\d+) of 1000; checkpoint (.*)", last
    )
    assert proc.returncode == 128 + signal.SIGTERM and stop, err[-2000:]
    assert "Traceback" not in err
    newest = checkpoint.checkpoints(ck)[-1]
    assert str(newest) == stop[2] and checkpoint.saved_step(newest) == int(stop[1])
    checkpoint.verify(newest)
    assert checkpoint.load_full(ck, load_factory(DATA).model) == int(stop[1])
    # Resumed into a build of another p: it continues at the next step.
    other = tmp_path / "p1"  # one rank reads both ranks' files
    emit(compile_model(DATA, "gpipe", 1, 4), other)
    steps = int(stop[1]) + 1
    cmd, env = torchrun(other / "launch.py", 1, "--threads", "1", "--resume", str(ck))
    run = subprocess.run(
        [*cmd, "--steps", str(steps)], env=env, capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert re.findall(r"step +(\d+)/", run.stdout) == [str(steps)]


@pytest.mark.slow
def test_sigkill_to_pipec_run_ends_the_run(build, tmp_path):
    """Z holds steps 5 and 10; `pipec run --resume Z/step_000005 --save Z --save-every 1`
    starts a branch. While it trains, every socket its processes listen on is on loopback and
    a second run of the build is refused in one line. SIGKILL to its process group (a CI
    cancel) leaves no process of it alive; step 10 is kept aside, Z's newest is the branch's,
    and measured/metrics.jsonl holds whole lines."""
    z = tmp_path / "Z"
    lineage = Lineage.new(load(build).plan, load(build).plan_hash, None)
    saved(z, 5, lineage)
    saved(z, 10, lineage)
    cmd = [sys.executable, "-m", "pipec", "run", str(build), "--threads", "1", "--steps", "1000"]
    resume = ["--resume", str(z / "step_000005"), "--save", str(z), "--save-every", "1"]
    env = torchrun(build / "launch.py", 1)[1]
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(
            [*cmd, *resume], env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
            start_new_session=True,
        )  # fmt: skip
    for line in proc.stdout:
        if re.match(r"step +7/", line):
            break
    tree = set(_descendants(proc.pid)) | {proc.pid}
    listening = _listening(tree)
    assert listening and all(_loopback(address) for address in listening), listening
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
    assert f"{build} is being run already (pid " in second.stderr
    os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _alive(tree):
        time.sleep(0.1)
    assert not _alive(tree), "processes left behind 20 s after SIGKILL"
    proc.wait()
    assert "a new branch; step_000010 moved to" in (tmp_path / "stderr").read_text()
    assert checkpoint.saved_step(next(z.glob("abandoned-*/step_000010"))) == 10  # kept
    newest, _ = checkpoint.newest_intact(z)
    assert checkpoint.saved_step(newest) >= 6
    assert checkpoint.manifest(newest)["run"]["resumed_from"] == str(z / "step_000005")
    lines = (build / "measured" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines][:2] == [6, 7]


def _listening(pids: set[int]) -> list[str]:
    """The addresses (hex, as /proc/net/tcp* writes them) of the TCP sockets `pids` listen on."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1].rsplit(":", 1)[0])
    return found


def _loopback(address: str) -> bool:
    """Whether a /proc/net/tcp* address (hex, 32-bit words in host order) is 127/8 or ::1,
    or ::ffff:127/8."""
    words = [
        int(address[i : i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(address), 8)
    ]
    ip = ipaddress.ip_address(b"".join(words))
    return ip.is_loopback or (
        ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback
    )


def _alive(pids: set[int]) -> bool:
    """Whether any of `pids` still runs (a zombie has exited)."""
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            return True
    return False


# -- pipec run: refused before any rank starts ----------------------------------------------------


@pytest.fixture
def no_torchrun(monkeypatch):
    """Starting torchrun fails the test: a refusal must come before it."""

    def popen(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError(f"torchrun started: {args}")

    monkeypatch.setattr(subprocess, "Popen", popen)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "-1"], "launch option: --steps must be at least 1"),
        (["--steps", "abc"], "launch option: argument --steps: invalid int value: 'abc'"),
        (["--bogus"], "launch option: unrecognized arguments: --bogus"),
        (["--nproc", "-1"], "--nproc -1: this build runs 2 ranks"),
        (["--nproc", "0"], "--nproc 0: this build runs 2 ranks"),
        (["--save", "FILE"], "is a file; name a directory"),
        (["--save", "FILE/sub"], "cannot write there (Not a directory)"),
        (["--precision", "fp8"], "invalid choice: 'fp8'"),
        (["--max-norm", "-1"], "--max-norm -1: the norm to clip to must be positive"),
        (["--zero", "1"], "--zero 1 shards the optimizer over data-parallel copies"),
        (["--max-restarts", "2"], "--max-restarts 2: a restarted run resumes from the newest"),
        (["--max-restarts", "-1", "--save", "DIR"], "--max-restarts -1: give 0 (no restart)"),
        (["--max-restarts", "1", "--check-grads"], "--check-grads runs one step and saves"),
        (["--max-restarts", "x"], "Invalid value for '--max-restarts': 'x' is not a valid"),
    ],
)
def test_pipec_run_refuses_before_starting(build, tmp_path, capsys, no_torchrun, args, message):
    (tmp_path / "FILE").write_text("")
    args = [a.replace("FILE", str(tmp_path / "FILE")).replace("DIR", str(tmp_path)) for a in args]
    nproc = args[:2] if args[0] == "--nproc" else []
    rest = args[2:] if nproc else args
    said = refused(capsys, "run", str(build), *nproc, *rest)
    assert message in said
    assert said.count("--help lists them") <= 1  # the hint once, not launch.py's and ours


def test_pipec_run_refuses_a_corrupted_plan(build, tmp_path, capsys, no_torchrun):
    copy = shutil.copytree(build, tmp_path / "b")
    (copy / "plan.json").write_text((copy / "plan.json").read_text()[:-40])
    assert "plan.json: corrupted plan" in refused(capsys, "run", str(copy))


# -- provenance -----------------------------------------------------------------------------------


@pytest.fixture
def own_build(tmp_path) -> tuple[Path, Path]:
    """A build of a factory file of its own (to edit), and that file."""
    factory = tmp_path / "factories.py"
    factory.write_text((ROOT / "tests" / "train_factories.py").read_text())
    out = tmp_path / "build"
    emit(compile_model(f"{factory}:copying", "1f1b", 2, 4), out)
    return out, factory


def test_an_edited_factory_is_refused(own_build, tmp_path, monkeypatch, capsys, no_torchrun):
    out, factory = own_build
    marker = Marker(tmp_path)
    factory.write_text(factory.read_text() + f"\n{marker.code()}\n")
    named = f"{factory}: the model's factory changed since"
    assert named in refused(capsys, "verify", str(out))
    assert named in refused(capsys, "run", str(out))
    assert named in said_by_rank_0(out, monkeypatch, capsys, world=2)
    assert not marker


def test_a_plan_pointing_at_another_file_is_refused(own_build, tmp_path, capsys):
    out, _ = own_build
    marker = Marker(tmp_path)
    other = tmp_path / "other.py"
    other.write_text(f"{marker.code()}\n")
    plan = json.loads((out / "plan.json").read_text())
    plan["model"]["factory"] |= {"file": str(other), "sha256": sha256(other)}
    text = json.dumps(plan, indent=1)
    (out / "plan.json").write_text(text)
    for program in out.glob("*rank_*.pipe"):  # headers made to match, as an attacker would
        program.write_text(re.sub(r"plan=\w+", f"plan={plan_hash(text)}", program.read_text()))
    launch = (out / "launch.py").read_text()
    (out / "launch.py").write_text(re.sub(r"plan \w+", f"plan {plan_hash(text)}", launch))
    assert "is not the file of its spec" in refused(capsys, "verify", str(out))
    assert not marker


def test_an_edited_launch_py_is_refused(build, tmp_path, capsys, no_torchrun):
    copy = shutil.copytree(build, tmp_path / "b")
    launch = copy / "launch.py"
    launch.write_text(launch.read_text() + "\nprint('hello')\n")
    named = f"{launch}: not the launch.py this plan generates"
    assert named in refused(capsys, "verify", str(copy))
    assert named in refused(capsys, "run", str(copy))


# -- the command line -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["simulate", "-s", "1f1b", "-p", "4", "-m", "8", "--costs", "F=1e308,B=1e308"],
         "--costs F must be at most 1e+15"),
        (["compile", "-s", "1f1b", "-p", "4", "-m", "8", "--dp", "100000", "--out", "OUT"],
         "--dp 100000: 400000 ranks in all (p=4); pipec builds at most 65536 ranks"),
        (["show", "BUILD", "--width", "100000000"], "100000000 is not in the range 10<=x<=10000"),
        (["export", "BUILD", "-o", "FILE"], "--out FILE exists; pass --force"),
        (["compile", "EXIT7", "-s", "1f1b", "-p", "2", "-m", "2", "--out", "OUT"],
         "raised SystemExit: 7"),
        (["plan", DATA, "-p", "2", "-B", "8", "--memory-per-device", "1GiB", "--runs", "0"],
         "Invalid value for '--runs': 0 is not in the range x>=1"),
        (["plan", DATA, "-p", "2", "-B", "8", "--memory-per-device", "1GiB", "--threads", "0"],
         "Invalid value for '--threads': 0 is not in the range x>=1"),
        (["plan", DATA, "-p", "2", "-B", "8", "--memory-per-device", "1GiB", "--comm", "-1"],
         "Invalid value for '--comm': -1.0 is not in the range x>=0"),
        (["plan", DATA, "-p", "2", "-B", "8", "--memory-per-device", "1GiB",
          "--time-budget", "-1"],
         "Invalid value for '--time-budget': -1.0 is not in the range x>0"),
    ],
)  # fmt: skip
def test_cli_refusals(build, tmp_path, capsys, argv, message):
    (tmp_path / "FILE").write_text("kept")
    (tmp_path / "exit7.py").write_text("import sys\nsys.exit(7)\n")
    names = {"BUILD": str(build), "FILE": str(tmp_path / "FILE"), "OUT": str(tmp_path / "out")}
    names["EXIT7"] = f"{tmp_path / 'exit7.py'}:tiny"
    argv = [names.get(a, a) for a in argv]
    message = message.replace("FILE", names["FILE"])
    assert message in refused(capsys, *argv)
    assert (tmp_path / "FILE").read_text() == "kept" and not (tmp_path / "out").exists()


def test_control_characters_in_paths_are_shown_escaped(build, tmp_path, capsys):
    """An --out holding ESC sequences and a carriage return cannot rewrite the terminal."""
    out = tmp_path / "x\x1b[2J\ry"
    out.write_text("kept")
    said = refused(capsys, "export", str(build), "-o", str(out))
    assert "x\\x1b[2J\\ry exists" in said and "\x1b" not in said and "\r" not in said
    main(["compile", "-s", "1f1b", "-p", "2", "-m", "2", "--out", str(tmp_path / "b\x1b[31m")])
    wrote = capsys.readouterr().out
    assert f"wrote {tmp_path}/b\\x1b[31m/:" in wrote and "\x1b" not in wrote


def test_os_errors_name_the_out_not_a_temporary(tmp_path):
    e = OSError(30, "Read-only file system", str(tmp_path / ".build.tmp-8387-ca9a7d14"))
    assert os_error(e) == f"--out {tmp_path / 'build'}: Read-only file system"
    inner = OSError(28, "No space left on device", str(tmp_path / "x.csv"))
    assert os_error(inner) == f"{tmp_path / 'x.csv'}: No space left on device"


def test_a_model_checkpoint_loads_in_transformers(tmp_path):
    """The model part of a checkpoint of a Hugging Face model, exported next to its config,
    is what `from_pretrained` loads."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    ck = checkpoint.save(tmp_path / "ck", 5, checkpoint.state_dict([model], None))
    out = tmp_path / "hf"
    checkpoint.export_model(ck, out)
    config.save_pretrained(out)
    loaded = transformers.LlamaForCausalLM.from_pretrained(out)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0)
