"""How a front end says where a sandbox is after a tier move (freeze, store, wake), in one line:
the CLI's ``forkd freeze|store|wake`` and the magics' ``%forkd freeze|store|wake`` print it."""

from __future__ import annotations


def tier_said(info: dict) -> str:
    """``sb-…: frozen``, or after a wake ``sb-…: running (woken from stored in 812 ms: fetch 3,
    decompress 640, restore 169 ms)``, from the sandbox's JSON the move answered."""
    said = f"{info['id']}: {info.get('tier', 'running')}"
    wake = info.get("wake") or {}
    if wake.get("from") not in (None, "running"):
        said += f" (woken from {wake['from']} in {wake['ms']:.0f} ms"
        if wake["from"] == "stored":
            said += (f": fetch {wake['fetch_ms']:.0f}, decompress {wake['decompress_ms']:.0f}, "
                     f"restore {wake['restore_ms']:.0f} ms")
        said += ")"
    return said
