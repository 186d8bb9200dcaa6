"""docs/reference.md, generated from the parsers themselves, so it cannot drift from them: every
`pipec` command with its arguments and options (click), then every option of a build's
launch.py and of `pipec run` after the build (runtime/options.py, which defines them, writes
their table).

    python -m pipec.reference docs/reference.md     # rewrite it; tests/test_docs.py checks it
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from pipec.markdown import cell

HEADER = """# Reference: commands and launch options

Generated from pipec's own parsers by `python -m pipec.reference docs/reference.md`; a test
fails when this page and the parsers differ. `pipec COMMAND -h` prints the same.
"""


def _click_option(param: click.Parameter, ctx: click.Context) -> tuple[str, str, str]:
    names, _ = param.get_help_record(ctx) or (param.human_readable_name, "")
    help_text = getattr(param, "help", None) or ""
    default = param.get_default(ctx, call=False)
    unset = default is None or default is getattr(click.core, "UNSET", None) or default == ()
    hidden = unset or callable(default) or getattr(param, "is_flag", False)
    return f"`{cell(names)}`", cell(help_text), "" if hidden else f"`{default}`"


def commands_markdown(group: click.Group) -> str:
    """A section per command: its usage line, its help and its options as a table."""
    parts = []
    for name in sorted(group.commands):
        cmd = group.commands[name]
        ctx = click.Context(cmd, info_name=f"pipec {name}")
        usage = " ".join(cmd.collect_usage_pieces(ctx))
        parts.append(f"### pipec {name}\n\n```text\npipec {name} {usage}\n```\n")
        parts.append((cmd.help or "").strip() + "\n")
        options = [
            p for p in cmd.get_params(ctx) if isinstance(p, click.Option) and "--help" not in p.opts
        ]
        if options:
            rows = ["| option | what | default |", "|---|---|---|"]
            rows += ["| {} | {} | {} |".format(*_click_option(p, ctx)) for p in options]
            parts.append("\n".join(rows) + "\n")
    return "\n".join(parts)


def render() -> str:
    from pipec.cli import cli
    from pipec.runtime.options import reference_markdown

    return (
        f"{HEADER}\n## Commands\n\n{commands_markdown(cli)}\n"
        "## Launch options\n\n"
        "What `BUILD/launch.py` takes under torchrun, and `pipec run BUILD` after the build; a "
        "`--config FILE.toml` file takes the same names as keys.\n\n"
        f"{reference_markdown()}"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(render())
    else:
        print(render(), end="")
