"""Per-sandbox memory and pids limits through cgroups, v2 where its controllers are enabled, else v1."""

from __future__ import annotations

import contextlib
import errno
import os

ROOT = "/sys/fs/cgroup"


class CgroupError(OSError):
    pass


def _controllers_v2(path: str) -> set[str]:
    try:
        with open(os.path.join(path, "cgroup.controllers")) as f:
            return set(f.read().split())
    except OSError:
        return set()


def locate(controller: str) -> tuple[str, str] | None:
    """Where ``controller`` ("memory" or "pids") can be used: ("v2"|"v1", hierarchy path)."""
    for v2 in (ROOT, os.path.join(ROOT, "unified")):
        if controller in _controllers_v2(v2):
            return "v2", v2
    v1 = os.path.join(ROOT, controller)
    if os.path.isdir(v1) and os.access(v1, os.W_OK) and not os.path.exists(os.path.join(v1, "cgroup.controllers")):
        return "v1", v1
    return None


_FILES = {("memory", "v2"): "memory.max", ("memory", "v1"): "memory.limit_in_bytes",
          ("pids", "v2"): "pids.max", ("pids", "v1"): "pids.max"}


class Cgroups:
    """Creates ``<hierarchy>/<group>/<name>`` leaves with limits and removes them when empty."""

    def __init__(self, group: str = "forkd"):
        self.group = group

    def status(self) -> dict:
        return {c: (locate(c) or ("none", ""))[0] for c in ("memory", "pids")}

    def apply(self, name: str, pid: int, memory_mib: int | None, pids_max: int | None) -> list[str]:
        """Put ``pid`` into leaves limiting it; returns the leaf paths made."""
        made = []
        for controller, value in (("memory", memory_mib and memory_mib * 1024 * 1024), ("pids", pids_max)):
            if not value:
                continue
            where = locate(controller)
            if where is None:
                raise CgroupError(errno.ENOTSUP,
                                  f"cannot limit {controller}: no writable cgroup v2 '{controller}' controller "
                                  f"and no cgroup v1 '{controller}' hierarchy under {ROOT}; run as root "
                                  f"or enable the controller (echo +{controller} > cgroup.subtree_control)")
            version, base = where
            parent = os.path.join(base, self.group)
            leaf = os.path.join(parent, name)
            os.makedirs(leaf, exist_ok=True)
            with open(os.path.join(leaf, _FILES[(controller, version)]), "w") as f:
                f.write(str(value))
            if controller == "memory" and version == "v1":
                with contextlib.suppress(OSError):  # no swap accounting on many hosts
                    with open(os.path.join(leaf, "memory.memsw.limit_in_bytes"), "w") as f:
                        f.write(str(value))
            with open(os.path.join(leaf, "cgroup.procs"), "w") as f:
                f.write(str(pid))
            made.append(leaf)
        return made

    def remove(self, leaves: list[str]) -> list[str]:
        """Remove empty leaves; returns those still busy (a retired reaper may live in one)."""
        busy = []
        for leaf in leaves:
            try:
                os.rmdir(leaf)
            except FileNotFoundError:
                pass
            except OSError:
                busy.append(leaf)
        return busy

    def sweep(self) -> None:
        """Remove every empty leaf of ours (left behind by sandboxes that ended on their own)."""
        for controller in ("memory", "pids"):
            where = locate(controller)
            if where is None:
                continue
            parent = os.path.join(where[1], self.group)
            with contextlib.suppress(OSError):
                for name in os.listdir(parent):
                    path = os.path.join(parent, name)
                    if os.path.isdir(path):
                        with contextlib.suppress(OSError):
                            os.rmdir(path)
