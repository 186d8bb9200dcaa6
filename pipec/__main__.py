"""`python -m pipec` runs the CLI."""

from pipec.cli import run

run()
