"""Write docs/vllm-supervisor.1, the man page, from the command line's own parser (argparse-manpage).

    python scripts/make_manpage.py          # rewrite it
    python scripts/make_manpage.py --check  # exit 1 when it is out of date (a unit test runs this)
"""

from __future__ import annotations

import sys
from pathlib import Path

from argparse_manpage.manpage import Manpage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from supervisor.about import __version__
from supervisor.cli import build_parser

PAGE = Path(__file__).resolve().parents[1] / "docs" / "vllm-supervisor.1"


def render() -> str:
    data = {"project_name": "vllm-supervisor", "version": __version__, "date": f"version {__version__}",  # reproducible
            "manual_title": "vllm-supervisor manual", "description": "keep one vLLM engine alive",
            "url": "docs/interface.md (every command, key and exit status)"}
    return str(Manpage(build_parser(), data))


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python scripts/make_manpage.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
