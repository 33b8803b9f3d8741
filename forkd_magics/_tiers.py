"""The line ``%forkd freeze``, ``store`` and ``wake`` print: the CLI's (where the sandbox is now, and
how long a wake took), and for a wake of a running sandbox, that there was nothing to wake."""

from __future__ import annotations

from forkd_server.client._tiers import tier_said


def tier_line(info: dict) -> str:
    """``sb-…: frozen``, or after a wake ``sb-…: running (woken from stored in 812 ms: fetch 3,
    decompress 640, restore 169 ms)``."""
    said = tier_said(info)
    if "wake" in info and (info.get("wake") or {}).get("from") in (None, "running"):
        said += " (it was running: nothing to wake)"
    return said
