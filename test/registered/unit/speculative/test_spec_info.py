"""SpeculativeAlgorithm parsing and family checks."""

import pytest

from sglite.srt.server_args import SPECULATIVE_ALGORITHMS
from sglite.srt.speculative.spec_info import SpeculativeAlgorithm

SUITE = "unit-cpu"
EST_TIME = 2


def test_every_flag_value_parses():
    for name in SPECULATIVE_ALGORITHMS:
        assert SpeculativeAlgorithm.from_string(name).value == name
    assert SpeculativeAlgorithm.from_string(None).is_none()
    assert SpeculativeAlgorithm.from_string("dflash") is SpeculativeAlgorithm.DFLASH


def test_family():
    assert SpeculativeAlgorithm.DFLASH.is_dflash_family() and SpeculativeAlgorithm.DSPARK.is_dflash_family()
    assert not SpeculativeAlgorithm.EAGLE.is_dflash_family() and not SpeculativeAlgorithm.NONE.is_dflash_family()


def test_unknown_is_an_error():
    with pytest.raises(ValueError, match="--speculative-algorithm 'MEDUSA'"):
        SpeculativeAlgorithm.from_string("MEDUSA")
