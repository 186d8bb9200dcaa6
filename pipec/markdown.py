"""Markdown for the generated reference pages: what a table cell may hold."""

from __future__ import annotations


def cell(text: str) -> str:
    """`text` as one table cell: on one line, its pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")
