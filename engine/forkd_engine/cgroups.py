"""Per-sandbox memory and pids limits through cgroups, v2 where its controllers are enabled, else v1.

Each engine of each server has a subtree of its own, ``<hierarchy>/<prefix>/<id of its data dir>``,
so two servers on one host never share (or sweep) each other's leaves; one leaf per sandbox (or
snapshot setup) below it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import signal
import time

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
_UNLIMITED = {("memory", "v2"): "max", ("memory", "v1"): "-1", ("pids", "v2"): "max", ("pids", "v1"): "max"}


def subtree(prefix: str, data_dir: str) -> str:
    """The group of one engine's leaves: ``prefix/<12 hex digits of the data dir's path>``."""
    return f"{prefix}/{hashlib.sha1(os.path.realpath(data_dir).encode()).hexdigest()[:12]}"


class Cgroups:
    """Creates ``<hierarchy>/<group>/<name>`` leaves with limits and removes them when empty."""

    def __init__(self, group: str = "forkd"):
        self.group = group

    def status(self) -> dict:
        return {c: (locate(c) or ("none", ""))[0] for c in ("memory", "pids")}

    def _parent(self, version: str, base: str) -> str:
        parent = os.path.join(base, self.group)
        if version == "v2" and not os.path.isdir(parent):
            # v2 hands a controller to a group's children only when each ancestor enables it.
            path = base
            for part in self.group.split("/"):
                with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.subtree_control"), "w") as f:
                    f.write("+memory +pids")
                path = os.path.join(path, part)
                os.makedirs(path, exist_ok=True)
            with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.subtree_control"), "w") as f:
                f.write("+memory +pids")
        return parent

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
            leaf = os.path.join(self._parent(version, base), name)
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

    def move(self, name: str, pid: int) -> list[str]:
        """Put ``pid`` into leaves of its own, without limits, wherever memory and pids can be
        accounted (nowhere when neither can); returns the leaf paths made."""
        made = []
        for controller in ("memory", "pids"):
            where = locate(controller)
            if where is None:
                continue
            leaf = os.path.join(self._parent(*where), name)
            os.makedirs(leaf, exist_ok=True)
            with open(os.path.join(leaf, "cgroup.procs"), "w") as f:
                f.write(str(pid))
            if leaf not in made:
                made.append(leaf)
        return made

    @staticmethod
    def unlimit(leaves: list[str]) -> None:
        """Lift the memory and pids limits of these leaves (the leaves stay)."""
        for leaf in leaves:
            for controller in ("memory", "pids"):
                version = "v2" if os.path.exists(os.path.join(leaf, "cgroup.controllers")) else "v1"
                path = os.path.join(leaf, _FILES[(controller, version)])
                if not os.path.exists(path):
                    continue
                if controller == "memory" and version == "v1":  # memsw first: never below the plain limit
                    with contextlib.suppress(OSError), open(os.path.join(leaf, "memory.memsw.limit_in_bytes"), "w") as f:
                        f.write("-1")
                with open(path, "w") as f:
                    f.write(_UNLIMITED[(controller, version)])

    @staticmethod
    def limits_hit(leaves: list[str]) -> list[str]:
        """What stopped processes in these leaves: the pids limit refusing a fork, the OOM killer."""
        hit = []
        for leaf in leaves:
            with contextlib.suppress(OSError, ValueError), open(os.path.join(leaf, "pids.events")) as f:
                if int(dict(line.split() for line in f)["max"]):
                    with open(os.path.join(leaf, "pids.max")) as m:
                        hit.append(f"the pids limit ({m.read().strip()} processes and threads) refused a fork")
            for name in ("memory.events", "memory.oom_control"):  # v2, v1
                with contextlib.suppress(OSError, ValueError), open(os.path.join(leaf, name)) as f:
                    if int(dict(line.split() for line in f).get("oom_kill", 0)):
                        hit.append("the memory limit was reached and the OOM killer ended a process")
        return hit

    @staticmethod
    def procs(leaf: str) -> list[int]:
        with contextlib.suppress(OSError), open(os.path.join(leaf, "cgroup.procs")) as f:
            return [int(pid) for pid in f.read().split()]
        return []

    @classmethod
    def kill_all(cls, leaves: list[str], wait: float = 0.0) -> bool:
        """SIGKILL every process in these leaves; with ``wait``, wait up to that many seconds until
        they are empty. Returns whether they are."""
        deadline = time.monotonic() + wait
        while True:
            left = [pid for leaf in leaves for pid in cls.procs(leaf)]
            if not left:
                return True
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)  # the kernel tears the processes down; their leaves empty when it is done

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
