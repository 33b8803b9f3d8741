"""A cell's output as MCP content: text as text, pictures as image content, in the order it came.

Consecutive chunks of one stream are joined; stderr is marked as such; a rich result gives its
image (PNG, JPEG, GIF, WebP) as image content, else its plain text (else its Markdown, HTML or
JSON as text), as a notebook's front end picks the richest form it can show.
"""

from __future__ import annotations

import json

from mcp_types import ContentBlock, ImageContent, TextContent

IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
TEXT_TYPES = ("text/plain", "text/markdown", "text/html", "application/json", "image/svg+xml")


class CellOutput:
    """Collects a cell's events (``stream``, ``display_data``, ``execute_result``, ``error``)."""

    def __init__(self) -> None:
        self.blocks: list[ContentBlock] = []
        self._stream: tuple[str, list[str]] | None = None  # the stream being joined: (name, chunks)
        self.error: dict | None = None
        self.result_text: str | None = None
        self.images = 0

    def add(self, event: dict) -> str | None:
        """Take one event; returns a short line describing it for a progress message, or None."""
        kind = event.get("type")
        if kind == "stream":
            name, text = event.get("name", "stdout"), event.get("text", "")
            if self._stream is None or self._stream[0] != name:
                self._close_stream()
                self._stream = (name, [])
            self._stream[1].append(text)
            return text.rstrip("\n")[-200:] or None
        if kind in ("display_data", "execute_result", "update_display_data"):
            self._close_stream()
            data = event.get("data") or {}
            block = bundle_block(data)
            if block is not None:
                self.blocks.append(block)
                self.images += isinstance(block, ImageContent)
            if kind == "execute_result":
                self.result_text = data.get("text/plain")
            return f"{kind}: {', '.join(sorted(data))}"
        if kind == "error":
            self._close_stream()
            self.error = {k: event.get(k) for k in ("ename", "evalue", "traceback")}
            self.blocks.append(TextContent(type="text", text=error_text(self.error)))
            return f"{event.get('ename')}: {event.get('evalue')}"
        return None

    def _close_stream(self) -> None:
        if self._stream is not None:
            name, chunks = self._stream
            text = "".join(chunks)
            self.blocks.append(TextContent(type="text", text=text if name == "stdout" else f"[{name}]\n{text}"))
            self._stream = None

    def finish(self) -> list[ContentBlock]:
        self._close_stream()
        return self.blocks


def bundle_block(data: dict) -> ContentBlock | None:
    """The one content block that best shows a MIME bundle, or None for an empty one."""
    for mime in IMAGE_TYPES:
        if isinstance(data.get(mime), str):
            return ImageContent(type="image", data=data[mime].replace("\n", ""), mime_type=mime)
    for mime in TEXT_TYPES:
        if mime in data:
            value = data[mime]
            return TextContent(type="text", text=value if isinstance(value, str) else json.dumps(value))
    return None


def error_text(error: dict) -> str:
    """The user's code's error (its own traceback: the cell's, never this server's)."""
    lines = [f"{error.get('ename')}: {error.get('evalue')}"]
    tb = error.get("traceback") or []
    if tb:
        lines.append(_strip_ansi("\n".join(tb)))
    return "\n".join(lines)


def _strip_ansi(text: str) -> str:
    import re
    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)
