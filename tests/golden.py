"""The golden vectors produced by vLLM's own code, kept in ``tests/golden_vectors`` (see its README).

Tests import this module (``tests/`` is put on ``sys.path`` by the test module).
A missing folder or file fails the run loudly: golden tests are never skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

GOLDEN_DIR = Path(__file__).resolve().parent / "golden_vectors"


def golden_dir() -> Path:
    """``tests/golden_vectors``; fails the test run when it is missing."""
    path = GOLDEN_DIR.resolve()
    if not path.is_dir():
        pytest.fail(
            f"golden vectors not found at {path}",
            pytrace=False,
        )
    return path


def load_golden(name: str) -> dict:
    """One golden JSON file by name, e.g. ``"vllm_block_hashes.json"``."""
    path = golden_dir() / name
    if not path.is_file():
        pytest.fail(f"golden file missing: {path}", pytrace=False)
    return json.loads(path.read_text())


def from_json(value: object) -> object:
    """Golden JSON conventions -> Python: arrays are tuples, ``{"bytes_hex": h}`` is bytes."""
    if isinstance(value, list):
        return tuple(from_json(item) for item in value)
    if isinstance(value, dict) and value.keys() == {"bytes_hex"}:
        return bytes.fromhex(value["bytes_hex"])
    return value


def from_json_lists(value: object) -> object:
    """Like :func:`from_json` but arrays stay lists (what a msgpack decoder returns)."""
    if isinstance(value, list):
        return [from_json_lists(item) for item in value]
    if isinstance(value, dict) and value.keys() == {"bytes_hex"}:
        return bytes.fromhex(value["bytes_hex"])
    return value
