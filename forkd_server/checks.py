"""Input checks shared by the controller and its managers: tags, bounded integers and labels.

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


MAX_LABELS = 32


def check_labels(labels, what: str = "labels") -> dict[str, str]:
    """``labels``: an object of at most 32 string -> string pairs (keys like tags, plus ``/``;
    values up to 256 characters). ``None`` is no labels."""
    if labels is None:
        return {}
    if not isinstance(labels, dict):
        raise BadRequest(f"{what} must be an object of string keys and values, e.g. {{\"team\": \"ml\"}}")
    if len(labels) > MAX_LABELS:
        raise BadRequest(f"{what} may hold at most {MAX_LABELS} pairs, got {len(labels)}")
    for key, value in labels.items():
        if not isinstance(key, str) or not LABEL_KEY_RE.match(key):
            raise BadRequest(f"invalid label key {key!r}: use 1-128 characters from A-Z a-z 0-9 _ . - /")
        if not isinstance(value, str) or len(value) > 256:
            raise BadRequest(f"label {key} must be a string of at most 256 characters, got {value!r:.80}")
    return dict(labels)


LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/-]{0,127}\Z")
