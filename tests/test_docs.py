"""The docs still describe the code: every `pipec` command fenced in README.md and docs/*.md
runs, every transcript prints what pipec prints today, and every relative link and every file
path the docs name exists.

How the docs mark their commands:

- A fenced line that starts with `pipec `, `python -m pipec ` or `$ ` followed by one of those
  is a command (a trailing backslash continues it). It runs through `pipec.cli.main(argv)` in
  one worker process shared by all documents, in a temporary directory per document (with
  `examples/` linked in, so `examples/gpt.py:tiny` resolves), one command after another in
  document order: a build written by one command is there for the next, and a relative `--out`
  never leaves that directory. Absolute paths are refused (a reader's machine has no such
  directory).
- A comment at the end of a command line sets what it should do: `# exit 2 ...` for an example
  of an error (it must fail with that code), `# slow ...` for a command too slow for the suite
  or one that launches torchrun (not run; its options must still parse). Any other comment is
  prose.
- `> FILE` at the end of a command writes what it prints on stdout to FILE, as a shell would
  (a transcript then shows only its stderr).
- In a block whose commands start with `$ `, the lines after a command, up to the next `$ `
  line, are its output (stdout and stderr together) and must match what it prints now; a line
  `...` stands for any number of lines, and a plan hash (`plan` and 16 hex digits) for any
  hash: a model build's plan records the factory file's absolute path, which differs between
  checkouts. A transcript of a `# slow` `pipec run` is not rerun, but must come from the command
  shown: it holds the line the run prints from its options (`training to step N: AdamW lr ...`)
  and counts its steps to the command's --steps. Show a run's output in such a transcript,
  never in a `text` block, which nothing checks against a command.
- A block fenced as `text` is output or a synopsis, never a command.

A file that the docs name in backticks (`bench/x.py`) must exist, unless a comment
`<!-- planned: bench/x.py ... -->` in that document lists it as one that is being written.
So must every file the code names (in comments, docstrings and messages): a path from a folder
of the checkout (`runtime/p2p.py`, `docs/design.md`) or a document by name (`training.md`,
looked up at the top and in docs/); a stem that is one letter or all capitals (`bench/NAME.py`)
is a placeholder.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import subprocess
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from pipec.cli import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
PROMPT = re.compile(r"^\$\s+")
ENV = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+")  # PYTHONPATH=. pipec ... runs as pipec ...
COMMAND = re.compile(r"^(?:\.venv/bin/)?(?:pipec|python3? -m pipec)(?:\s|$)")
MARKER = re.compile(r"\s#\s*(exit (\d+)|slow)\b")
ELLIPSIS = {"...", "…"}


@dataclass
class Command:
    """One fenced command: where it is, its arguments, what it must do and print."""

    line: int
    text: str
    argv: list[str]
    exit_code: int | None  # None: too slow for the suite, not run
    output: list[str] | None  # a transcript's expected lines; None: output not checked
    stdout_to: str | None = None  # `> FILE`: where its stdout goes
    unreadable: str | None = None  # why the line is not a command a shell could read


def fenced_blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(info string, first line number, lines) of every fenced code block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.groups()
        body, start, i = [], i + 2, i + 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i].removeprefix(indent))
            i += 1
        blocks.append((info, start, body))
        i += 1
    return blocks


def _command(line: int, text: str) -> Command | None:
    """The command on a (joined) fenced line, or None when the line is not one."""
    text = ENV.sub("", PROMPT.sub("", text.strip()))
    if not COMMAND.match(text):
        return None
    marker = MARKER.search(text)
    exit_code = 0 if marker is None else None if marker[1] == "slow" else int(marker[2])
    try:
        argv = shlex.split(text, comments=True)
    except ValueError as e:  # an unclosed quote: prose or output fenced as a command
        return Command(line, text, [], exit_code, None, unreadable=f"shlex: {e}")
    stdout_to = None
    if len(argv) >= 2 and argv[-2] == ">":
        argv, stdout_to = argv[:-2], argv[-1]
    argv = argv[3:] if argv[0].startswith("python") else argv[1:]
    return Command(line, text, argv, exit_code, None, stdout_to)


def commands(text: str) -> list[Command]:
    """Every command fenced in one document, in order, with its transcript if it has one."""
    found = []
    for info, start, body in fenced_blocks(text):
        if info == "text":
            continue
        transcript = any(PROMPT.match(b) for b in body)
        current, i = None, 0
        while i < len(body):
            line, text = start + i, body[i]
            while text.endswith("\\") and i + 1 < len(body):
                i += 1
                text = text[:-1] + " " + body[i].strip()
            i += 1
            if transcript and not PROMPT.match(text):
                if current is not None and current.output is not None:
                    current.output.append(text)
                continue
            current = _command(line, text)
            if current is not None:
                current.output = [] if transcript else None
                found.append(current)
    return found


def _matches(expected: list[str], actual: str) -> bool:
    """Whether the printed text is the transcript's, `...` standing for any lines and a plan
    hash for any plan hash."""
    while expected and not expected[-1].strip():
        expected = expected[:-1]
    pattern = "".join(
        r"(?:[^\n]*\n)*?" if e.strip() in ELLIPSIS else _line_pattern(e) + r"\n" for e in expected
    )
    text = "".join(line.rstrip() + "\n" for line in actual.splitlines())
    return re.fullmatch(pattern, text) is not None


def _line_pattern(line: str) -> str:
    """A transcript line as a regular expression: itself, but any plan hash."""
    return PLAN_HASH.sub(lambda m: r"plan\ [0-9a-f]{16}", re.escape(line.rstrip()))


PLAN_HASH = re.compile(r"plan\\ [0-9a-f]{16}")


class Worker:
    """One process that runs every documented command through `pipec.cli.main(argv)`.

    Sharing it keeps the test fast (Python and torch start once) and keeps pipec's
    process-wide state out of the test session: a `--threads` of `pipec plan`, and stream
    objects that modules bind when they are first imported (a default `stream=sys.stderr`
    argument would otherwise keep writing into this test's capture after it ends).
    """

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.getenv("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )

    def run(self, cwd: Path, argv: list[str]) -> tuple[int, str, str, str]:
        """`pipec ARGV` run in CWD: its exit code, everything it printed, its stdout and its
        stderr."""
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"cwd": str(cwd), "argv": argv}) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"the docs worker died (exit {self.proc.wait()}) running {argv}")
        answer = json.loads(reply)
        return answer["code"], answer["printed"], answer["stdout"], answer["stderr"]

    def close(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class _Printed(io.TextIOBase):
    """The worker's stdout or stderr for the whole process: an object that never changes,
    writing into the current command's buffers (both streams together, and its own)."""

    both = io.StringIO()

    def __init__(self) -> None:
        self.own = io.StringIO()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.own.write(text)
        return _Printed.both.write(text)


def serve() -> None:
    """The worker's loop: one JSON request per line in, one JSON answer per line out."""
    from pipec.cli import main

    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray writes to fd 1 must not corrupt the answers
    sys.stdout, sys.stderr = out, err = _Printed(), _Printed()
    for line in sys.stdin:
        request = json.loads(line)
        os.chdir(request["cwd"])
        _Printed.both, out.own, err.own = io.StringIO(), io.StringIO(), io.StringIO()
        try:
            main(request["argv"])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        except Exception:  # noqa: BLE001 - a traceback is a failure to show, not a worker crash
            err.write(traceback.format_exc())
            code = 1
        printed = {"printed": _Printed.both.getvalue()}
        printed |= {"stdout": out.own.getvalue(), "stderr": err.own.getvalue()}
        answers.write(json.dumps({"code": code, **printed}) + "\n")
        answers.flush()


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.close()


def parses(argv: list[str]) -> str | None:
    """Why click refuses ARGV's options, or None: what a command too slow to run is held to."""
    command = cli.commands[argv[0]]
    try:
        with command.make_context(argv[0], argv[1:]):
            return None
    except click.ClickException as e:
        return e.format_message()


def _problem(cmd: Command, worker: Worker, cwd: Path) -> str | None:
    """Why a command's run does not match the docs, or None."""
    if cmd.unreadable:
        return f"{cmd.unreadable} (output or a synopsis belongs in a block fenced as text)"
    if any(a.startswith("/") for a in [*cmd.argv, cmd.stdout_to or ""]):
        return "an absolute path: give a path relative to the checkout"
    if not cmd.argv or (cmd.argv[0] not in cli.commands and not cmd.argv[0].startswith("-")):
        return f"'{cmd.argv[:1]}' is not a pipec command"
    if cmd.exit_code is None:
        return parses(cmd.argv) or (_run_transcript(cmd) if cmd.argv[0] == "run" else None)
    code, printed, stdout, stderr = worker.run(cwd, cmd.argv)
    if cmd.stdout_to is not None:
        (cwd / cmd.stdout_to).write_text(stdout)
        printed = stderr
    if code != cmd.exit_code:
        return f"exit {code}, the docs expect {cmd.exit_code}:\n{printed[-2000:]}"
    if cmd.output is not None and not _matches(cmd.output, printed):
        return "prints\n" + printed[-3000:] + "where the docs show\n" + "\n".join(cmd.output)
    return None


def _run_transcript(cmd: Command) -> str | None:
    """Why the transcript of a `pipec run` the suite does not run is not that command's, or
    None: it must show the line the run prints from its options (runtime/config.py's
    `LaunchConfig.training_line`), and its steps must count to --steps."""
    if not cmd.output:
        return None
    from pipec.runtime.options import parse_launch

    launch = cmd.argv[2:]
    for own in ("--nproc", "--max-restarts"):  # pipec run's own options, not launch.py's
        if own in launch:
            k = launch.index(own)
            launch = launch[:k] + launch[k + 2 :]
    try:
        config = parse_launch(launch)
    except SystemExit:
        return f"launch.py refuses {launch}"
    if config.run.check_grads:
        return None
    steps = config.training.steps
    expected = config.training_line()
    if expected not in cmd.output:
        return f"the transcript is not this command's: it should show\n  {expected}"
    counts = set(re.findall(r"^step +\d+/(\d+) ", "\n".join(cmd.output), re.MULTILINE))
    if counts - {str(steps)}:
        return f"the transcript counts steps to {sorted(counts)}, the command to {steps}"
    return None


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_fenced_command_runs_as_the_docs_say(
    doc: Path, tmp_path: Path, worker: Worker
) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    failures = []
    for cmd in commands(doc.read_text()):
        problem = _problem(cmd, worker, tmp_path)
        if problem:
            failures.append(f"{doc.name}:{cmd.line}: {cmd.text}\n  {problem}")
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
NAMED_FILE = re.compile(
    r"`(?:PYTHONPATH=\S+ )?(?:python3? )?((?:bench|tests|examples|pipec|passes|runtime|codegen)"
    r"/[\w/.-]+\.(?:py|pipe|j2|jsonl|json))(?![\w.])"
)
PLANNED = re.compile(r"<!--\s*planned:([^>]*)-->")


def _prose(text: str) -> str:
    """The document without its fenced blocks (links there are code, not links)."""
    lines = text.splitlines()
    inside = set()
    for _, start, body in fenced_blocks(text):
        inside.update(range(start - 2, start + len(body)))
    return "\n".join(line for i, line in enumerate(lines) if i not in inside)


def slugs(path: Path) -> set[str]:
    """GitHub's anchors of a document's headings."""
    heads = re.findall(r"^#+\s+(.*)$", _prose(path.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_every_relative_link_and_named_file_exists() -> None:
    missing = []
    for doc in DOCS:
        prose = _prose(doc.read_text())
        for target in LINK.findall(prose):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                missing.append(f"{doc.relative_to(ROOT)}: link to {target}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in slugs(path):
                missing.append(f"{doc.relative_to(ROOT)}: link to {target}: no such heading")
        text = doc.read_text()
        planned = {name for names in PLANNED.findall(text) for name in names.split()}
        for name in NAMED_FILE.findall(text):
            if name not in planned and not (ROOT / name).exists():
                missing.append(f"{doc.relative_to(ROOT)}: names {name}: no such file")
    if missing:
        pytest.fail("\n".join(sorted(set(missing))), pytrace=False)


def test_the_docs_test_reads_what_it_should(worker: Worker, tmp_path: Path) -> None:
    """The parser itself: markers, continuations, redirections, transcripts and text blocks."""
    doc = (
        "```\npipec simulate -s 1f1b \\\n  -p 4 -m 8   # a comment\n"
        "pipec simulate -s nope -p 4 -m 8   # exit 2: unknown\n"
        "python -m pipec plan x --pp 2   # slow: minutes\ntorchrun launch.py\n```\n"
        "```text\npipec plan examples/gpt.py:tiny: p=4\n```\n"
        "```console\n$ pipec schedules\n1f1b  v 1\n...\n$ pipec --help\n```\n"
        "```\npipec simulate -s 1f1b -p 2 -m 2 --json > sim.json\npipec runtime: the model's\n```\n"
    )
    cmds = commands(doc)
    assert [(c.argv[:2], c.exit_code) for c in cmds] == [
        (["simulate", "-s"], 0),
        (["simulate", "-s"], 2),
        (["plan", "x"], None),
        (["schedules"], 0),
        (["--help"], 0),
        (["simulate", "-s"], 0),
        ([], 0),
    ]
    assert cmds[0].argv == ["simulate", "-s", "1f1b", "-p", "4", "-m", "8"]
    assert cmds[3].output == ["1f1b  v 1", "..."]
    assert _matches(["a", "...", "d"], "a\nb\nc\nd\n") and not _matches(["a", "d"], "a\nb\nd\n")
    assert _matches(["wrote b/: plan 52cf14be6c0dcee0;"], "wrote b/: plan 801e910c08c86fc3;\n")
    assert not _matches(["wrote b/: plan 52cf14be6c0dcee0;"], "wrote c/: plan 801e910c08c86fc3;\n")
    assert _problem(cmds[1], worker, tmp_path) is None  # exits 2, as marked
    assert _problem(cmds[3], worker, tmp_path) is not None  # prints more than the transcript
    assert parses(["plan", "x", "--pp", "2"]) is not None  # --global-batch is required
    assert parses(["simulate", "-s", "1f1b", "--nope"]) is not None
    assert cmds[5].stdout_to == "sim.json" and _problem(cmds[5], worker, tmp_path) is None
    assert json.loads((tmp_path / "sim.json").read_text())["makespan"] == 9
    assert "No closing quotation" in (_problem(cmds[6], worker, tmp_path) or "")
    named = "`bench/data/x.jsonl`, `bench/y.py`; <!-- planned: bench/y.py -->"
    assert NAMED_FILE.findall(named) == ["bench/data/x.jsonl", "bench/y.py"]
    assert PLANNED.findall(named) == [" bench/y.py "]


def test_a_slow_run_s_transcript_must_come_from_its_command() -> None:
    """The hole a quick start once fell through: a run's output pasted under a command with
    other options (--lr 3e-3 then, the default 1e-3 shown)."""
    doc = (
        "```console\n$ pipec run build/gpt --steps 2 --lr 3e-3   # slow: torchrun\n"
        "training to step 2: AdamW lr 0.003, seed 0\nstep   1/2  loss 5.5\n...\n"
        "$ pipec run build/gpt --steps 2   # slow: torchrun\n"
        "training to step 2: AdamW lr 0.003, seed 0\nstep   1/2  loss 5.5\n"
        "$ pipec run build/gpt --lr 3e-3 --steps 3   # slow: torchrun\n"
        "training to step 3: AdamW lr 0.003, seed 0\nstep   1/2  loss 5.5\n```\n"
    )
    shown, default_lr, other_steps = commands(doc)
    assert _run_transcript(shown) is None
    assert "AdamW lr 0.001, seed 0" in (_run_transcript(default_lr) or "")
    assert "counts steps to ['2'], the command to 3" in (_run_transcript(other_steps) or "")


def test_a_run_s_output_is_shown_under_its_command() -> None:
    """A run's step lines in a `text` block are checked against nothing: they belong in the
    transcript of the command that printed them (where `_run_transcript` checks them)."""
    found = [
        f"{doc.relative_to(ROOT)}:{start}"
        for doc in DOCS
        for info, start, body in fenced_blocks(doc.read_text())
        if info == "text" and any(RUN_STEP.match(line) for line in body)
    ]
    assert not found, f"a run's output in a text block, not a transcript of its command: {found}"


RUN_STEP = re.compile(r"\s*step +\d+/\d+ +loss ")


def test_the_python_that_loads_a_checkpoint_runs(tmp_path: Path, monkeypatch) -> None:
    """docs/training.md's `load_full` example, run as written against a checkpoint of the
    model it names, saved where it looks."""
    from pipec import checkpoint
    from pipec.frontend import load_factory

    text = (ROOT / "docs/training.md").read_text()
    (code,) = [
        "\n".join(b)
        for info, _, b in fenced_blocks(text)
        if info == "python" and "load_full(" in "\n".join(b)
    ]
    found = re.search(r'load_factory\("([^"]+)"\).*load_full\("([^"]+)"', code, re.DOTALL)
    spec, where = found.groups()
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    model = load_factory(spec).model
    checkpoint.save(Path(where), 30, checkpoint.state_dict([model], None))
    namespace: dict = {}
    exec(compile(code, "docs/training.md", "exec"), namespace)  # noqa: S102 - the docs' own code
    assert namespace["step"] == 30


if __name__ == "__main__":
    serve()


CODE_PATH = re.compile(
    r"(?<![\w/.-])((?:docs|bench|tests|examples|pipec|passes|runtime|codegen)/[\w/.-]*\w"
    r"\.(?:py|md|j2|jsonl|json|toml|pipe|txt|csv))(?!\w)"
)
CODE_DOC = re.compile(r"(?<![\w/.-])([\w-]+\.md)\b")


def _source_files() -> list[Path]:
    from tests.helpers import checkout_files

    paths = checkout_files(ROOT)
    code = [p for p in paths if p.suffix in (".py", ".j2", ".toml") or p.name == "Makefile"]
    return [p for p in code if p.is_file() and not p.is_symlink()]


def missing_references(text: str) -> list[str]:
    """The files `text` (a source file) names that the checkout does not hold."""
    missing = []
    for name in CODE_PATH.findall(text):
        stem = Path(name).stem
        if len(stem) > 1 and not stem.isupper() and not (ROOT / name).exists():
            missing.append(name)
    for name in CODE_DOC.findall(text):
        if not ((ROOT / name).exists() or (ROOT / "docs" / name).exists()):
            missing.append(name)
    return missing


def test_every_file_the_code_names_exists() -> None:
    gone, facts = "runtime/" + "gone.py", "FACTS" + ".md"  # not named in this file itself
    planted = f'"""See {facts}, {gone} and training.md; bench/NAME.py is a placeholder."""'
    assert missing_references(planted) == [gone, facts]
    missing = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in _source_files()
        for name in missing_references(path.read_text())
    ]
    assert not missing, "the code names files the checkout does not hold:\n" + "\n".join(missing)


def test_the_reference_is_what_the_parsers_say() -> None:
    from pipec.reference import render

    page = ROOT / "docs" / "reference.md"
    assert page.read_text() == render(), (
        "docs/reference.md differs from the parsers: python -m pipec.reference docs/reference.md"
    )
    assert "### pipec compile" in page.read_text() and "| `--steps STEPS` |" in page.read_text()


def test_the_readme_reads_in_five_minutes() -> None:
    words = len(re.findall(r"\S+", (ROOT / "README.md").read_text()))
    assert words <= 1000, f"README.md has {words} words; move depth to docs/"


def test_the_set_up_quotes_no_suite_time() -> None:
    """A duration of the suite pasted by hand goes stale with the next test."""
    pasted = re.compile(r"\d+ passed|make test` takes \d+|\d+(-\d+)? minutes on 2 cores")
    for path in [ROOT / "README.md", ROOT / "Makefile"]:
        assert not pasted.search(path.read_text()), f"{path.relative_to(ROOT)} quotes a suite time"
