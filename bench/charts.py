"""The Gantt charts of docs/charts.md: compile a few schedules and render their schedule.svg
to PNG under docs/img/.

    python bench/charts.py [--out docs/img]

Each chart is the `schedule.svg` that `pipec compile` writes for the command printed beside
it; the PNG is that file rendered by resvg (`pip install -e '.[docs]'`, only needed here).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

from pipec.cli import main

ROOT = Path(__file__).resolve().parents[1]

#: (file name, `pipec compile` arguments): the families docs/charts.md shows.
CHARTS = [
    ("1f1b", "-s 1f1b -p 4 -m 8"),
    ("interleaved", "-s interleaved -p 4 -m 8 -v 2"),
    ("zb-v", "-s zb-v -p 4 -m 8"),
    ("bitpipe", "-s bitpipe -p 4 -m 8"),
    ("1f1b-evict", "-s 1f1b -p 4 -m 8 --evict --memory-limit 3"),
]


def render_png(svg: Path, png: Path) -> None:
    """`svg` as a PNG at twice its size (sharp on high-density screens)."""
    try:
        import resvg_py
    except ImportError:
        sys.exit("bench/charts.py renders with resvg: pip install -e '.[docs]'")
    data = resvg_py.svg_to_bytes(
        svg_path=str(svg),
        zoom=2,
        background="white",
        font_dirs=["/usr/share/fonts"],
        monospace_family="DejaVu Sans Mono",
    )
    png.write_bytes(bytes(data))


def main_charts() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    ap.add_argument("--only", default="", help="comma-separated chart names")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in CHARTS:
            if only and name not in only:
                continue
            build = Path(tmp) / name
            main(["compile", *shlex.split(flags), "--out", str(build)])
            render_png(build / "schedule.svg", args.out / f"{name}.png")
            print(f"{args.out / name}.png: pipec compile {flags}")


if __name__ == "__main__":
    main_charts()
