"""``python -m sglite.launch_server [flags]`` (and ``sglite serve``): parse flags, resolve the model, serve.

Without ``--model-path`` the embedded default model is served (``sglite.srt.default_model``).
"""

from __future__ import annotations

import logging
import sys
import traceback
from typing import Optional, Sequence

from sglite.srt.default_model import describe_model_choice, resolve_default_model
from sglite.srt.entrypoints.preflight import run_preflight
from sglite.srt.server_args import ServerArgs, ServerArgsError

logger = logging.getLogger("sglite.launch_server")

MODULE_PROG = "python -m sglite.launch_server"


def main(argv: Optional[Sequence[str]] = None, prog: str = MODULE_PROG) -> int:
    """Parse flags, resolve the default model, launch the server; the process exit status.

    ``prog`` is how the user invoked it (``sglite serve`` passes its own), shown in --help and errors."""
    parsed = ServerArgs.from_cli(argv, prog=prog)
    try:
        args = resolve_default_model(parsed).validate()
        run_preflight(args)  # before any process starts or weight loads: one line naming the flag
    except ServerArgsError as e:
        if parsed.log_level == "debug":
            traceback.print_exc()
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="[%(asctime)s %(processName)s] %(levelname)s %(name)s: %(message)s",
    )
    logger.info(describe_model_choice(parsed, args))
    if args.node_rank > 0:  # a node other than 0 of a multi-node server: its scheduler ranks only
        from sglite.srt.entrypoints.launcher import run_worker_node

        return run_worker_node(args)
    from sglite.srt.entrypoints.http_server import launch_server

    return launch_server(args)


if __name__ == "__main__":
    sys.exit(main())
