"""Content checksums of checkpoint files: written into the commit marker after saving, checked before
loading, so a flipped bit or a zero-filled block is caught even when every size is right."""
from __future__ import annotations

import json
import re
import zlib
from pathlib import Path
from typing import Any

CHUNK = 1 << 20
MARKER = "COMMITTED"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def crc32_of(path: Path) -> str:
    """CRC-32 of the file's bytes, streamed, as 8 hex digits."""
    crc = 0
    with path.open("rb") as stream:
        while chunk := stream.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def manifest(folder: Path, exclude: str) -> dict[str, Any]:
    """``files``: name -> size (what older markers hold too) and ``crc32``: name -> checksum."""
    files = [p for p in sorted(folder.iterdir()) if p.name != exclude]
    return {"files": {p.name: p.stat().st_size for p in files}, "crc32": {p.name: crc32_of(p) for p in files}}


def content_problem(folder: Path, marker: dict[str, Any]) -> str | None:
    """The first file whose bytes differ from its recorded checksum, or None. Markers without
    checksums (written before they were recorded) pass: their sizes were checked already."""
    for name, expected in (marker.get("crc32") or {}).items():
        file = folder / name
        try:
            actual = crc32_of(file)
        except OSError as error:
            return f"{name} is unreadable ({error.strerror})"
        if actual != expected:
            return f"{name} does not match its checksum (crc32 {actual}, recorded {expected})"
    return None


def has_checksums(marker: dict[str, Any]) -> bool:
    return bool(marker.get("crc32"))


def completeness_problem(path: Path) -> str | None:
    """Why a checkpoint folder is not complete, or None. The marker lists every file's size, so a
    truncated or missing file is caught before any rank starts reading."""
    if not STEP_DIR.match(path.name):
        return "not committed: written by a run that stopped while saving"
    marker = path / MARKER
    if not marker.exists():
        return f"no {MARKER} marker"
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return f"unreadable {MARKER} marker"
    if not isinstance(recorded, dict) or not isinstance(recorded.get("files"), dict) or "step" not in recorded:
        return f"{MARKER} marker without its step and file list"
    for name, size in recorded["files"].items():
        file = path / name
        if not file.exists() or file.stat().st_size != size:
            return f"{name} is missing or truncated"
    return None


def checkpoint_problem(path: Path) -> str | None:
    """Why a checkpoint folder cannot be used, or None: complete (sizes) and, where the marker holds
    checksums, every file's content as written."""
    problem = completeness_problem(path) if path.exists() else "no such folder"
    if problem is not None:
        return problem
    return content_problem(path, json.loads((path / MARKER).read_text()))
