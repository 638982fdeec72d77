"""Content checksums of checkpoint files: written into the commit marker after saving, checked before
loading, so a flipped bit or a zero-filled block is caught even when every size is right."""
from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

CHUNK = 1 << 20


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
