"""What runs on the machine, read from /proc by the tests themselves (not through the launcher under test)."""

from __future__ import annotations

from pathlib import Path


def living(marker: str | bytes) -> list[int]:
    """PIDs of living (not zombie) processes whose command line holds ``marker`` (a server's and its stubs')."""
    needle = marker.encode() if isinstance(marker, str) else marker
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue  # gone meanwhile
        if needle in cmdline and state != "Z":
            found.append(int(entry.name))
    return found
