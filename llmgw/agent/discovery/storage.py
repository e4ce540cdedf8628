"""Disks and model weights on this machine: free space of given paths, model directories under given roots."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from llmgw import wire

log = logging.getLogger(__name__)

MODEL_MARKER = "config.json"  # a directory holding this file is a model (Hugging Face layout)
MAX_DEPTH = 5  # deep enough for a Hugging Face cache: models--org--name/snapshots/<rev>/config.json


def disk_usage(paths: Sequence[str]) -> list[wire.StorageInfo]:
    """Total and free bytes of the filesystem holding each path; paths that do not exist are skipped."""
    found = []
    for path in paths:
        try:
            usage = shutil.disk_usage(path)
        except OSError as exc:
            log.info("storage path %s skipped: %s", path, exc)
            continue
        found.append(wire.StorageInfo(path=str(path), total_bytes=usage.total, free_bytes=usage.free))
    return found


def find_local_weights(roots: Sequence[str]) -> list[wire.LocalWeights]:
    """Every directory under ``roots`` that holds a ``config.json``, with the size of its files.

    A model directory is not searched further. Hugging Face cache snapshots
    (``models--org--name/snapshots/REV``) are named ``org/name``; other models
    by their path relative to the root. Sizes follow symbolic links (the cache
    links snapshot files to blobs).
    """
    found: dict[str, wire.LocalWeights] = {}
    for root in roots:
        base = Path(root)
        if not base.is_dir():
            log.info("weight root %s skipped: not a directory", root)
            continue
        for model_dir in _model_dirs(base, MAX_DEPTH):
            path = str(model_dir)
            if path not in found:
                found[path] = wire.LocalWeights(path=path, name=_model_name(base, model_dir),
                                                size_bytes=_tree_size(model_dir))
    return [found[path] for path in sorted(found)]


def _model_dirs(directory: Path, depth: int):
    if (directory / MODEL_MARKER).is_file():
        yield directory
        return
    if depth == 0:
        return
    try:
        children = sorted(child for child in directory.iterdir() if child.is_dir())
    except OSError:
        return
    for child in children:
        yield from _model_dirs(child, depth - 1)


def _model_name(root: Path, model_dir: Path) -> str:
    parts = model_dir.relative_to(root).parts
    for i, part in enumerate(parts):
        if part.startswith("models--") and parts[i + 1:i + 2] == ("snapshots",):
            return part.removeprefix("models--").replace("--", "/")
    return "/".join(parts) or model_dir.name


def _tree_size(directory: Path) -> int:
    total = 0
    for folder, _dirs, files in os.walk(directory):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except OSError:
                continue  # a dangling link: an incomplete download
    return total
