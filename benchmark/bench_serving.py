"""Online serving benchmark against a running server; the same as `sglite bench serving`."""

import sys

from sglite.bench_serving import main

if __name__ == "__main__":
    sys.exit(main())
