"""Bench scripts run as documented (`PYTHONPATH=$PWD python bench/X.py`), although Python puts
bench/ itself first on sys.path, where bench/runtime.py would shadow the `runtime` package."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
PACKAGES = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}


def _imported_roots(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name.split(".")[0] for a in node.names}
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return {node.module.split(".")[0]}
    return set()


def _puts_checkout_first(node: ast.stmt) -> bool:
    """`sys.path.insert(0, ...)` as a statement."""
    call = node.value if isinstance(node, ast.Expr) else None
    return (
        isinstance(call, ast.Call)
        and ast.unparse(call.func) == "sys.path.insert"
        and ast.unparse(call.args[0]) == "0"
    )


@pytest.mark.parametrize("script", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_no_bench_script_imports_a_shadowed_package_before_fixing_sys_path(script: Path):
    """A package with a namesake in bench/ (runtime) is imported only after the script has put
    the checkout first on sys.path, by a module-level statement that runs before the import."""
    shadowed = PACKAGES & {p.stem for p in BENCH.glob("*.py")}
    assert "runtime" in shadowed  # the case this guards; if bench/runtime.py goes, drop the test
    tree = ast.parse(script.read_text())
    fixed_at = next((n.lineno for n in tree.body if _puts_checkout_first(n)), None)
    top_level = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        names = _imported_roots(node) & shadowed if isinstance(node, ast.stmt) else set()
        # A module-level import runs in line order; one inside a function, after all of them.
        runs_after_fix = fixed_at is not None and (
            id(node) not in top_level or fixed_at < node.lineno
        )
        assert not names or runs_after_fix, (
            f"{script.name}:{node.lineno} imports {names} before sys.path.insert(0, ROOT)"
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it would run the benchmark")
def test_attention_bench_without_cuda_says_it_skipped():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = [sys.executable, "bench/attention.py"]
    proc = subprocess.run(script, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "skipped: needs a CUDA GPU" in proc.stdout


def test_precision_bench_runs_or_names_the_missing_option():
    """bench/precision.py --help works; without launch.py --precision it says so, exit 2
    (its runs take minutes: not run here)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = [sys.executable, "bench/precision.py", "--steps", "0"]
    kw = {"cwd": ROOT, "env": env, "capture_output": True, "text": True}
    helped = subprocess.run([*run, "--help"], check=False, **kw)
    assert helped.returncode == 0 and "fp32 against bf16" in helped.stdout
    from runtime.main import launch_parser

    if "--precision" not in {s for a in launch_parser()._actions for s in a.option_strings}:
        proc = subprocess.run(run, check=False, **kw)
        assert proc.returncode == 2 and "has no --precision option yet" in proc.stderr
