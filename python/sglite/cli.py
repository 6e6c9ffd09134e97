"""`sglite` command line: serve | plan | bench."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

USAGE = """usage: sglite {serve,plan,bench} [options]

  serve   launch the OpenAI-compatible server (default model when --model-path is absent)
  plan    print the exact per-rank KV memory plan of a topology, simulated on this machine
  bench   run a benchmark: serving | one-batch | spec | vs-transformers | memory-plan
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Dispatch to a subcommand."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = args[0], args[1:]
    if cmd == "serve":
        from sglite.launch_server import main as serve_main

        return serve_main(rest, prog="sglite serve") or 0
    if cmd == "plan":
        from sglite.srt.planner import main as plan_main

        return plan_main(rest) or 0
    if cmd == "bench":
        from sglite.bench import main as bench_main

        return bench_main(rest) or 0
    print(f"sglite: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
