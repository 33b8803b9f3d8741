"""Input checks shared by the controller and its managers: tags and bounded integers.

Each raises ``BadRequest`` with a message that says what a valid value looks like.
"""

from __future__ import annotations

import re

from .errors import BadRequest

TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}\Z")
MAX_CHILDREN = 1000
BRANCH_MODES = ("full", "diff", "live")
ENGINES = ("auto", "process", "vm")


def check_tag(tag, what: str = "tag") -> str:
    if not isinstance(tag, str) or not TAG_RE.match(tag):
        raise BadRequest(f"invalid {what} {tag!r}: use 1-64 characters from A-Z a-z 0-9 _ . -, "
                         f"not starting with '.' or '-'")
    return tag


def int_field(value, name: str, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise BadRequest(f"{name} must be between {lo} and {hi}" if hi else f"{name} must be at least {lo}")
    return value
