"""Input checks shared by the controller and its managers: tags, bounded integers and labels.

Each raises ``BadRequest`` with a message that says what a valid value looks like.
"""

from __future__ import annotations

import math
import os
import re

from ..errors import BadRequest

TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}\Z")
MAX_CHILDREN = 1000
BRANCH_MODES = ("full", "diff", "live")
ENGINES = ("auto", "process", "vm")


def check_tag(tag, what: str = "tag") -> str:
    if not isinstance(tag, str) or not TAG_RE.match(tag):
        raise BadRequest(f"invalid {what} {tag!r}: use 1-64 characters from A-Z a-z 0-9 _ . -, "
                         f"not starting with '.' or '-'")
    return tag


def int_field(value, name: str, lo: int, hi: int | None = None, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {value!r:.40}")
    if value < lo or (hi is not None and value > hi):
        bound = f"{name} must be between {lo} and {hi}" if hi is not None else f"{name} must be at least {lo}"
        raise BadRequest(bound + (f" ({why})" if why else "") + f", got {value!r:.40}")
    return value


# --- the bounds of snapshot create and spawn: every number has one, stated by its 400 -----------

MAX_SETUP_TIMEOUT_SECS = 86400
MAX_DISK_MIB = 1 << 20


def host_memory_mib() -> int:
    """This host's RAM in MiB (MemTotal)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    raise OSError("no MemTotal in /proc/meminfo")


def check_memory_mib(value, name: str, lo: int) -> int:
    """A memory size in MiB (``memory_limit_mib``, a VM's ``mem_size_mib``): at most the host's RAM."""
    return int_field(value, name, lo, host_memory_mib(), "MiB; at most this host's memory")


HOST_MEMORY = "host"  # a memory_limit_mib of all this host's memory, whichever host takes the call


def memory_limit(value, name: str = "memory_limit_mib") -> int | None:
    """``memory_limit_mib`` as a caller gave it: None (the engine's default), ``"host"`` (this host's
    memory, for a caller that cannot know which host it reaches or how much memory that host has:
    the forkd kernel, behind a fleet's router), or MiB, 16 to this host's memory."""
    if value is None:
        return None
    if value == HOST_MEMORY:
        return host_memory_mib()
    if isinstance(value, str):
        raise BadRequest(f'{name} must be a number of MiB or "host" (this host\'s memory), got {value!r:.40}')
    return check_memory_mib(value, name, 16)


def check_disk_mib(value, data_dir: str) -> int:
    """A VM's data disk: at most the free space where its files go (and 1 TiB)."""
    st = os.statvfs(data_dir)
    free = st.f_bavail * st.f_frsize >> 20
    return int_field(value, "disk_mib", 16, min(MAX_DISK_MIB, free),
                     f"MiB; at most 1 TiB and the free space of {data_dir}")


def check_setup_timeout(value) -> float:
    """``setup_timeout_secs``: how long a snapshot's creation may take, start-up included."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"setup_timeout_secs must be a number of seconds, got {value!r:.40}")
    if not 1 <= value <= MAX_SETUP_TIMEOUT_SECS:
        raise BadRequest(f"setup_timeout_secs must be between 1 and {MAX_SETUP_TIMEOUT_SECS} (a day), got {value!r}")
    return float(value)


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
