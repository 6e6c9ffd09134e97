"""SpeculativeAlgorithm: the ``--speculative-algorithm`` value as an enum with the family questions callers ask."""

from __future__ import annotations

import enum
from typing import Optional


class SpeculativeAlgorithm(enum.Enum):
    """Speculative decoding algorithms known to the flags; only the DFLASH family is served."""

    NONE = "NONE"
    DFLASH = "DFLASH"
    DSPARK = "DSPARK"
    EAGLE = "EAGLE"
    STANDALONE = "STANDALONE"

    @classmethod
    def from_string(cls, name: Optional[str]) -> "SpeculativeAlgorithm":
        """Parse a flag value (None means no speculation); an unknown name is a clear error."""
        if name is None:
            return cls.NONE
        try:
            return cls(name.upper())
        except ValueError:
            raise ValueError(
                f"unknown --speculative-algorithm {name!r}; choose one of {[a.value for a in cls if a is not cls.NONE]}"
            ) from None

    def is_none(self) -> bool:
        """No speculation."""
        return self is SpeculativeAlgorithm.NONE

    def is_dflash_family(self) -> bool:
        """Block-diffusion drafts (DFLASH, DSPARK): own KV geometry, target-feature context KV, one block forward."""
        return self in (SpeculativeAlgorithm.DFLASH, SpeculativeAlgorithm.DSPARK)
