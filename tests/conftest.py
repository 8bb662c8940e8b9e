"""Shared test fixtures."""

from pathlib import Path

import pytest

from workbook.tiny_model import ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The tiny model directory in the default cache: built once (about 45 s), then reused."""
    return ensure_tiny_model()
