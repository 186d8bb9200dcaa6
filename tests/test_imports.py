"""pipec is one import package: its folders passes/, codegen/ and runtime/ are imported as
`pipec.passes`, `pipec.codegen` and `pipec.runtime` everywhere, no import cycle crosses two of
the top-level folders, and triton is optional.

A cycle between modules of two folders makes either one impossible to change, test or import
alone (the launcher importing the runtime's private parser while the runtime imported the
launcher's checks was one). Imports inside functions count: they run too. Imports under
`if TYPE_CHECKING:` do not.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import networkx as nx

from tests.helpers import checkout_files

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("pipec", "passes", "codegen", "runtime")
SUBPACKAGES = FOLDERS[1:]


def _tracked(*suffixes: str) -> list[Path]:
    paths = checkout_files(ROOT)
    return [p for p in paths if p.suffix in suffixes and p.is_file() and not p.is_symlink()]


def _imports(tree: ast.AST) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every absolute import that runs: `if TYPE_CHECKING:` skipped."""
    found: list[tuple[int, str, list[str]]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_nothing_imports_the_subpackages_by_their_folder_names():
    """`import runtime` would work only from a checkout, and would shadow (or be shadowed by)
    a user's file of that name; launch.py's template is checked too."""
    bad = []
    for path in _tracked(".py"):
        for line, module, _ in _imports(ast.parse(path.read_text(), str(path))):
            if module.split(".")[0] in SUBPACKAGES:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    top_level = re.compile(rf"^\s*(?:from|import)\s+({'|'.join(SUBPACKAGES)})\b", re.MULTILINE)
    for path in _tracked(".j2"):
        bad += [
            f"{path.relative_to(ROOT)}: imports {m}" for m in top_level.findall(path.read_text())
        ]
    assert not bad, "import them as pipec.passes, pipec.codegen, pipec.runtime:\n" + "\n".join(bad)


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts if parts[0] == "pipec" else ["pipec", *parts])


def _folder(module: str) -> str:
    second = module.split(".")[1:2]
    return second[0] if second and second[0] in SUBPACKAGES else "pipec"


def import_graph() -> nx.DiGraph:
    """Modules of the four folders, an edge for each import that runs (a submodule imports its
    parent packages' `__init__` too)."""
    files = [p for p in _tracked(".py") if p.relative_to(ROOT).parts[0] in FOLDERS]
    modules = {_module(p): p for p in files}
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for _, module, names in _imports(ast.parse(path.read_text(), str(path))):
            targets = {module, *(f"{module}.{n}" for n in names)}
            parts = module.split(".")
            targets |= {".".join(parts[:k]) for k in range(1, len(parts))}
            graph.add_edges_from((name, t) for t in targets if t in modules and t != name)
    return graph


def test_no_import_cycle_crosses_two_top_level_folders():
    crossing = [
        sorted(c)
        for c in nx.strongly_connected_components(import_graph())
        if len({_folder(m) for m in c}) > 1
    ]
    assert not crossing, f"import cycles across folders: {crossing}"


def test_the_graph_sees_a_cycle_when_there_is_one():
    """The check above can fail: the runtime's preflight imports the launcher's checks, so the
    checks importing it back would close a cycle."""
    graph = import_graph()
    assert graph.has_edge("pipec.runtime.preflight", "pipec.run_checks")
    graph.add_edge("pipec.run_checks", "pipec.runtime.preflight")
    assert any(
        len(c) > 1 and "pipec.run_checks" in c for c in nx.strongly_connected_components(graph)
    )


NO_TRITON = """
import sys, warnings
sys.modules["triton"] = None  # `import triton` raises ImportError, as without the package
import torch
from pipec.runtime.kernels import attention
import examples.gpt, examples.llama
q = torch.randn(1, 2, 8, 16)
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    out = attention(q, q, q, is_causal=True)
torch.testing.assert_close(
    out, torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
)
print(sys.modules["pipec.runtime.kernels.attention"].flash, *(str(w.message) for w in said))
"""


def test_without_triton_attention_runs_sdpa_and_the_examples_import():
    env = {"PIPEC_ATTENTION": "triton", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", NO_TRITON],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("None ")
    assert "triton is not installed (pip install 'pipec[gpu]'); using SDPA" in proc.stdout
