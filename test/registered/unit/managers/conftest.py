"""Shared fixtures for the serving-manager unit tests: one tiny tokenizer per session."""

import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer (vocab 512, ChatML template) loaded through transformers."""
    from transformers import AutoTokenizer

    from sglite.testing.tiny_tokenizer import build_tiny_tokenizer

    path = build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))
    return AutoTokenizer.from_pretrained(path)
