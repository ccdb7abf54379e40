"""Run in the engine's own interpreter by `vllm-supervisor doctor`: does the installed vLLM accept
these arguments?

The arguments come as a JSON list on stdin (never on a command line another user could read); vLLM's
own serve parser reads them, then vLLM's own checks of a parsed command line. Exit 0: accepted; 2:
refused, vLLM's message on stderr; 3: this vLLM has no parser where it is looked for.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    argv = json.loads(sys.stdin.read())
    try:
        try:
            from vllm.utils.argparse_utils import FlexibleArgumentParser
        except ImportError:
            from vllm.utils import FlexibleArgumentParser  # type: ignore[no-redef,attr-defined]
        try:
            from vllm.entrypoints.launchers.cli_args import (
                make_arg_parser,
                validate_parsed_serve_args,
            )
        except ImportError:
            from vllm.entrypoints.openai.cli_args import (  # type: ignore[no-redef]
                make_arg_parser,
                validate_parsed_serve_args,
            )
    except ImportError as exc:
        print(f"this vLLM's serve parser was not found: {exc}", file=sys.stderr)
        return 3
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    args = parser.parse_args(argv)  # argparse exits 2 with its message
    try:
        validate_parsed_serve_args(args)
    except Exception as exc:  # noqa: BLE001 - vLLM raises what it likes here
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
