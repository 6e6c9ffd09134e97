"""`sglite bench NAME`: run one of the benchmarks (serving lives in the package, the rest in benchmark/)."""

from __future__ import annotations

import os
import runpy
import sys
from typing import Optional, Sequence

# name -> script under the repository's benchmark/ folder
SCRIPTS = {
    "one-batch": "bench_one_batch.py",
    "spec": "bench_spec.py",
    "vs-transformers": "bench_vs_transformers.py",
    "memory-plan": "bench_memory_plan.py",
    "attention": "bench_attention.py",
    "default-acceptance": "bench_default_acceptance.py",
}


def _benchmark_dir() -> str:
    # Editable installs keep the repository layout: python/sglite/bench.py -> ../../benchmark
    return os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "benchmark"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Dispatch `sglite bench NAME [args]`."""
    args = list(sys.argv[1:] if argv is None else argv)
    names = ["serving", *SCRIPTS]
    if not args or args[0] in ("-h", "--help"):
        print("usage: sglite bench {" + ",".join(names) + "} [options]")
        return 0
    name, rest = args[0], args[1:]
    if name == "serving":
        from sglite.bench_serving import main as serving_main

        return serving_main(rest)
    if name not in SCRIPTS:
        print(f"sglite bench: unknown benchmark {name!r}; choose one of {names}", file=sys.stderr)
        return 2
    path = os.path.join(_benchmark_dir(), SCRIPTS[name])
    if not os.path.isfile(path):
        print(f"sglite bench: {path} not found (run from a source checkout: pip install -e .)", file=sys.stderr)
        return 2
    sys.argv = [path, *rest]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:  # scripts end with sys.exit(main())
        return int(e.code or 0)
    return 0
