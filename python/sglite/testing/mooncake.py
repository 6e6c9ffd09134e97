"""Whether Mooncake's transfer engine can be imported here, and if not, what to install (a pytest skip reason).

Mooncake's CPU build (``mooncake-transfer-engine-non-cuda``, in the test extra) links Debian's
``libibverbs1`` and ``librdmacm1``. Without them ``import mooncake.engine`` raises an ``ImportError``
about a missing shared object, which ``pytest.importorskip`` does not skip (it skips only a missing
module), so a clean host would fail at collection instead of skipping the tests that need them.
"""

from __future__ import annotations

import functools
from typing import Optional

INSTALL_SYSTEM_LIBS = "apt-get install libibverbs1 librdmacm1"


@functools.lru_cache(maxsize=1)
def mooncake_unavailable() -> Optional[str]:
    """None when ``mooncake.engine`` imports; otherwise why not and what to install."""
    try:
        import mooncake.engine  # noqa: F401
    except ModuleNotFoundError as e:
        return f"{e}: pip install mooncake-transfer-engine-non-cuda (it is in the test extra: pip install -e '.[test]')"
    except (ImportError, OSError) as e:
        return f"Mooncake's CPU build needs Debian's libibverbs1 and librdmacm1 ({e}); install them: {INSTALL_SYSTEM_LIBS}"
    return None


def needs_mooncake():
    """A pytest mark that skips a test (or a module, as ``pytestmark``) when Mooncake cannot be imported."""
    import pytest

    reason = mooncake_unavailable()
    return pytest.mark.skipif(reason is not None, reason=reason or "")
