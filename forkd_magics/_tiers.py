"""The line ``%forkd freeze``, ``store`` and ``wake`` print: where the sandbox is now, and how long a
wake took (from stored, split as the server measured it)."""

from __future__ import annotations


def tier_line(info: dict) -> str:
    """``sb-…: frozen``, or after a wake ``sb-…: running (woken from stored in 812 ms: fetch 3,
    decompress 640, restore 169 ms)``."""
    said = f"{info['id']}: {info.get('tier', 'running')}"
    wake = info.get("wake") or {}
    if wake.get("from") not in (None, "running"):
        said += f" (woken from {wake['from']} in {wake['ms']:.0f} ms"
        if wake["from"] == "stored":
            said += (f": fetch {wake['fetch_ms']:.0f}, decompress {wake['decompress_ms']:.0f}, "
                     f"restore {wake['restore_ms']:.0f} ms")
        said += ")"
    elif "wake" in info:
        said += " (it was running: nothing to wake)"
    return said
