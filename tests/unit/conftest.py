"""Shared fixtures for the pure unit tests: realistic HL7 samples from tests/data."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

DATA_DIR = Path(__file__).resolve().parent.parent / "data"


@pytest.fixture
def hl7_sample() -> Callable[[str], bytes]:
    """Load a sample message from tests/data by file name, bytes exactly as stored."""

    def load(name: str) -> bytes:
        return (DATA_DIR / name).read_bytes()

    return load
