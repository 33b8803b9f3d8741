"""Per-sandbox memory, pids and huge-page limits through cgroups, v2 where a controller is enabled,
else v1 (a host may mix them: here memory and pids are v1 and hugetlb is v2).

Each engine of each server has a subtree of its own, ``<hierarchy>/<prefix>/<id of its data dir>``,
so two servers on one host never share (or sweep) each other's leaves; one leaf per sandbox (or
snapshot setup, or branch) below it.

Huge pages (hugetlb) are not charged to the memory controller, so a leaf with a memory limit also
caps them, separately, at the same figure: 2 MiB pages up to the memory limit, faults and
reservations alike, and every other huge page size at 0. A sandbox thus holds at most its limit in
ordinary memory and at most its limit in huge pages; a ``MAP_HUGETLB`` past the cap fails (ENOMEM at
``mmap``, SIGBUS at the fault of a ``MAP_NORESERVE`` mapping), and the host's pool is never drained.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import select
import secrets
import signal
import threading
import time

from .base import LimitHit

ROOT = "/sys/fs/cgroup"


class CgroupError(OSError):
    pass


def _counter(leaf: str, name: str, key: str | None) -> int:
    """A counter of a cgroup file: the value of ``key`` in a "key value" file, or (key None) the
    file's single number; 0 where the file is absent."""
    try:
        with open(os.path.join(leaf, name)) as f:
            text = f.read()
        if key is None:
            return int(text)
        return int(dict(line.split() for line in text.splitlines() if line.strip()).get(key, 0))
    except (OSError, ValueError):
        return 0


def _limit(leaf: str, *names: str) -> int:
    """A limit of a leaf, from the first of ``names`` it has (v2's, then v1's); -1 for none ("max")."""
    for name in names:
        with contextlib.suppress(OSError, ValueError), open(os.path.join(leaf, name)) as f:
            text = f.read().strip()
            value = -1 if text == "max" else int(text)
            return -1 if value >= 1 << 60 else value  # v1's "unlimited" is a number near 2^63
    return -1


def _controllers_v2(path: str) -> set[str]:
    try:
        with open(os.path.join(path, "cgroup.controllers")) as f:
            return set(f.read().split())
    except OSError:
        return set()


def locate(controller: str) -> tuple[str, str] | None:
    """Where ``controller`` ("memory", "pids" or "hugetlb") can be used: ("v2"|"v1", hierarchy path)."""
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
CONTROLLERS = ("memory", "pids", "hugetlb")
FREEZE_WAIT = 10.0  # s a leaf has to report itself frozen or thawed
HUGE_SIZE = "2MB"  # the huge page size sandboxes may use (process/hugepages.py); every other is capped at 0
# A huge-page cap file: faults ("max", v1 "limit_in_bytes") and reservations ("rsvd."...), per size.
_HUGETLB_CAP = re.compile(r"hugetlb\.(\w+)\.(?:rsvd\.)?(?:max|limit_in_bytes)")


def _hugetlb_caps(leaf: str) -> dict[str, list[str]]:
    """The huge-page cap files of a leaf, by page size ("2MB": [fault cap, reservation cap])."""
    caps: dict[str, list[str]] = {}
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(leaf)):
            m = _HUGETLB_CAP.fullmatch(name)
            if m:
                caps.setdefault(m[1], []).append(os.path.join(leaf, name))
    return caps


def _cap_hugetlb(leaf: str, nbytes: int, caps: dict[str, list[str]] | None = None) -> None:
    """Cap the leaf's huge pages: ``nbytes`` of 2 MiB pages, faults and reservations; none of any
    other size (``caps``: the leaf's cap files, as ``_hugetlb_caps`` finds them). Raises
    CgroupError where the reservations cannot be capped (before Linux 5.7): a reservation of
    surplus pages takes them from the host however the faults are capped."""
    caps = _hugetlb_caps(leaf) if caps is None else caps
    if len(caps.get(HUGE_SIZE, [])) != 2:
        raise CgroupError(errno.ENOTSUP, f"{leaf} has no fault and reservation caps for {HUGE_SIZE} huge pages "
                                         f"(hugetlb.{HUGE_SIZE}.rsvd.* needs Linux 5.7)")
    for size, paths in caps.items():
        for path in paths:
            with open(path, "w") as f:
                f.write(str(nbytes if size == HUGE_SIZE else 0))


def _removed(leaf: str) -> bool:
    """rmdir a leaf; False while it is busy (a process is still in it, or the kernel still tears one
    down). A leaf already gone counts as removed."""
    try:
        os.rmdir(leaf)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def leaf_name(kind: str, tag: str) -> str:
    """A leaf's name for a setup or a branch of snapshot ``tag``: unique to this one, so a snapshot
    made again under a tag never shares (or kills, or limits) the leaves its previous one's reaper
    may still hold."""
    return f"{kind}-{tag}-{secrets.token_hex(4)}"


def subtree(prefix: str, data_dir: str) -> str:
    """The group of one engine's leaves: ``prefix/<12 hex digits of the data dir's path>``."""
    return f"{prefix}/{hashlib.sha1(os.path.realpath(data_dir).encode()).hexdigest()[:12]}"


_MEMORY_USAGE = {"v2": ("memory.max", "memory.current"), "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes")}


def memory_room(group: str, where: tuple[str, str] | None = None) -> int | None:
    """Bytes the memory limits above ``group``'s leaves still allow: the smallest ``limit - usage``
    over the group and each of its ancestors up to the hierarchy's root (a container's own group,
    under a cgroup namespace), for those that have a limit; None where none has. ``where``: the
    memory hierarchy (``locate("memory")``), when the caller knows it. A few small file reads:
    cheap enough for a health check."""
    where = where or locate("memory")
    if where is None:
        return None
    version, base = where
    limit_file, usage_file = _MEMORY_USAGE[version]
    paths, path = [base], base
    for part in group.split("/"):
        path = os.path.join(path, part)
        paths.append(path)
    room = None
    for path in paths:
        limit = _limit(path, limit_file) if os.path.isdir(path) else -1
        if limit < 0:
            continue
        left = max(0, limit - _counter(path, usage_file, None))
        room = left if room is None else min(room, left)
    return room


class Cgroups:
    """Creates ``<hierarchy>/<group>/<name>`` leaves with limits and removes them when empty."""

    def __init__(self, group: str = "forkd"):
        self.group = group
        self._enabled: set[tuple[str, str]] = set()  # (v2 hierarchy, controller) enabled down to our group
        self.caps_huge_pages = False  # whether leaves cap huge pages: once hugetlb_status() found they hold
        self.janitor = Janitor()  # removes given-up leaves once their last process has exited
        # Found once, as where the hierarchies are does not change while we run: each controller's
        # place (``_where``), and the names of a leaf's huge-page cap files (a spawn's leaves).
        self._located: dict[str, tuple[str, str] | None] = {}
        self._hugetlb_names: dict[str, dict[str, list[str]]] = {}

    def status(self) -> dict:
        return {c: (locate(c) or ("none", ""))[0] for c in CONTROLLERS}

    def memory_room(self) -> int | None:
        """What the memory limits over this engine's leaves still allow (``memory_room``)."""
        where = self._where("memory")
        return memory_room(self.group, where) if where else None

    def _where(self, controller: str) -> tuple[str, str] | None:
        """``locate(controller)``, asked once."""
        if controller not in self._located:
            self._located[controller] = locate(controller)
        return self._located[controller]

    def _parent(self, version: str, base: str, controller: str) -> str:
        parent = os.path.join(base, self.group)
        if version == "v2" and (base, controller) not in self._enabled:
            # v2 hands a controller to a group's children only when each ancestor enables it (one
            # controller a write: a write naming one the hierarchy lacks would enable none).
            path = base
            for part in self.group.split("/") + [None]:
                with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.subtree_control"), "w") as f:
                    f.write(f"+{controller}")
                if part is not None:
                    path = os.path.join(path, part)
                    os.makedirs(path, exist_ok=True)
            self._enabled.add((base, controller))
        return parent

    def hugetlb_status(self) -> tuple[bool, str]:
        """(enforced, why): whether this host caps each leaf's huge pages, tried on a leaf of ours;
        from then on the leaves made cap them (where they do not hold, they are left alone)."""
        where = locate("hugetlb")
        if where is None:
            return False, (f"no cgroup v2 'hugetlb' controller and no cgroup v1 'hugetlb' hierarchy under {ROOT}, "
                           f"so huge pages could not be capped per sandbox")
        probe = os.path.join(self._parent(*where, "hugetlb"), f"probe-{os.getpid()}")
        try:
            os.makedirs(probe, exist_ok=True)
            _cap_hugetlb(probe, 0)
        except OSError as exc:
            return False, f"huge pages cannot be capped per sandbox ({where[0]} hugetlb at {where[1]}): {exc}"
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(probe)
        self.caps_huge_pages = True
        return True, f"each sandbox's huge pages are capped at its memory limit (cgroup {where[0]} hugetlb at {where[1]})"

    def apply(self, name: str, pid: int | list[int], memory_mib: int | None, pids_max: int | None) -> list[str]:
        """Put ``pid`` (or each of a list) into leaves limiting it (a memory limit caps huge pages
        too, with ``caps_huge_pages``); returns the leaf paths made."""
        leaves = self.prepare(name, memory_mib, pids_max)
        self.join(leaves, pid)
        return leaves

    @staticmethod
    def join(leaves: list[str], pid: int | list[int]) -> None:
        """Put ``pid`` (or each of a list) into these leaves (made by ``prepare``)."""
        for leaf in leaves:
            fd = os.open(os.path.join(leaf, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
            try:
                for one in pid if isinstance(pid, list) else [pid]:
                    os.write(fd, str(one).encode())  # a pid a write
            finally:
                os.close(fd)

    def prepare(self, name: str, memory_mib: int | None, pids_max: int | None) -> list[str]:
        """Make the leaves ``apply`` puts a process into, with their limits, and nothing in them yet
        (a spawn makes its children's while the template forks them); returns their paths."""
        made = []
        memory = memory_mib and memory_mib * 1024 * 1024
        for controller, value in (("memory", memory), ("pids", pids_max),
                                  ("hugetlb", memory if self.caps_huge_pages else None)):
            if not value:
                continue
            where = self._where(controller)
            if where is None:
                raise CgroupError(errno.ENOTSUP,
                                  f"cannot limit {controller}: no writable cgroup v2 '{controller}' controller "
                                  f"and no cgroup v1 '{controller}' hierarchy under {ROOT}; run as root "
                                  f"or enable the controller (echo +{controller} > cgroup.subtree_control)")
            version, base = where
            parent = self._parent(version, base, controller)
            leaf = os.path.join(parent, name)
            os.makedirs(leaf, exist_ok=True)
            if controller == "hugetlb":
                _cap_hugetlb(leaf, value, self._hugetlb_caps_of(parent, leaf))
            else:
                with open(os.path.join(leaf, _FILES[(controller, version)]), "w") as f:
                    f.write(str(value))
            if controller == "memory" and version == "v1":
                with contextlib.suppress(OSError):  # no swap accounting on many hosts
                    with open(os.path.join(leaf, "memory.memsw.limit_in_bytes"), "w") as f:
                        f.write(str(value))
            if leaf not in made:
                made.append(leaf)
        return made

    def _hugetlb_caps_of(self, parent: str, leaf: str) -> dict[str, list[str]]:
        """``_hugetlb_caps(leaf)``, its names read once for every leaf of ``parent``."""
        names = self._hugetlb_names.get(parent)
        if names is not None:
            return {size: [os.path.join(leaf, n) for n in found] for size, found in names.items()}
        caps = _hugetlb_caps(leaf)
        if len(caps.get(HUGE_SIZE, [])) == 2:  # kept only where they can cap (else _cap_hugetlb says why)
            self._hugetlb_names[parent] = {size: [os.path.basename(p) for p in paths] for size, paths in caps.items()}
        return caps

    def move(self, name: str, pid: int | list[int]) -> list[str]:
        """Put ``pid`` (a new template, or it and its init) into leaves of its own wherever memory and pids can be
        accounted (nowhere when neither can): without memory and pids limits, and with no huge page
        of its own (``caps_huge_pages``; a template only forks, and the huge pages it holds are its
        source's, charged there).
        Returns the leaf paths made."""
        made = []
        for controller in CONTROLLERS:
            where = locate(controller)
            if where is None or (controller == "hugetlb" and not self.caps_huge_pages):
                continue
            leaf = os.path.join(self._parent(*where, controller), name)
            os.makedirs(leaf, exist_ok=True)
            if controller == "hugetlb":
                _cap_hugetlb(leaf, 0)
            for one in pid if isinstance(pid, list) else [pid]:
                with open(os.path.join(leaf, "cgroup.procs"), "w") as f:
                    f.write(str(one))
            if leaf not in made:
                made.append(leaf)
        return made

    @staticmethod
    def unlimit(leaves: list[str]) -> None:
        """Lift the memory and pids limits of these leaves (the leaves stay). The huge-page cap stays:
        a template takes no more huge pages, and it bounds what work a lossy setup left could take."""
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
    def raise_memory(leaves: list[str], memory_mib: int) -> None:
        """Raise the memory limit of a sandbox's leaves to ``memory_mib``, and its huge-page cap with
        it (the cap is the memory limit, where huge pages are capped). Never lowers either: below what
        a sandbox holds, the kernel would reclaim its memory or kill it."""
        nbytes = memory_mib << 20
        for leaf in leaves:
            version = "v2" if os.path.exists(os.path.join(leaf, "cgroup.controllers")) else "v1"
            path = os.path.join(leaf, _FILES[("memory", version)])
            if os.path.exists(path) and 0 <= _limit(leaf, _FILES[("memory", version)]) < nbytes:
                if version == "v1":  # memsw first: never below the plain limit
                    with contextlib.suppress(OSError), open(os.path.join(leaf, "memory.memsw.limit_in_bytes"), "w") as f:
                        f.write(str(nbytes))
                with open(path, "w") as f:
                    f.write(str(nbytes))
            huge = _hugetlb_caps(leaf).get(HUGE_SIZE)
            # a cap of 0 is "no huge pages at all" (a template, a host that cannot cap them): kept
            if huge and 0 < _limit(leaf, f"hugetlb.{HUGE_SIZE}.max", f"hugetlb.{HUGE_SIZE}.limit_in_bytes") < nbytes:
                _cap_hugetlb(leaf, nbytes)

    @staticmethod
    def hits(leaves: list[str]) -> list[LimitHit]:
        """The limits the kernel enforced on the processes of these leaves, with their values: the
        OOM killer at the memory limit, the huge-page cap refusing a page (the process faulting it
        got SIGBUS, or its mmap ENOMEM), the pids limit refusing a fork. Read before the leaves go."""
        hit = []
        for leaf in leaves:
            kills = max(_counter(leaf, "memory.events", "oom_kill"), _counter(leaf, "memory.oom_control", "oom_kill"))
            if kills:
                mib = _limit(leaf, "memory.max", "memory.limit_in_bytes") >> 20
                ended = "a process" if kills == 1 else f"{kills} processes"
                hit.append(LimitHit("memory", mib, kills, f"the memory limit was reached ({mib} MiB): the kernel's "
                                                          f"OOM killer ended {ended} in it"))
            refused = max(_counter(leaf, f"hugetlb.{HUGE_SIZE}.events", "max"),
                          _counter(leaf, f"hugetlb.{HUGE_SIZE}.failcnt", None))
            if refused:
                mib = _limit(leaf, f"hugetlb.{HUGE_SIZE}.max", f"hugetlb.{HUGE_SIZE}.limit_in_bytes") >> 20
                hit.append(LimitHit("huge_pages", mib, refused,
                                    f"the huge-page cap ({mib} MiB of {HUGE_SIZE} pages, as much as the memory limit) "
                                    f"refused {HUGE_SIZE} pages (a process faulting one gets SIGBUS, an mmap of them "
                                    f"ENOMEM)"))
            forks = _counter(leaf, "pids.events", "max")
            if forks:
                most = _limit(leaf, "pids.max")
                hit.append(LimitHit("pids", most, forks, f"the pids limit ({most} processes and threads) refused a fork"
                                                         + (f" ({forks} times)" if forks > 1 else "")))
        return hit

    @staticmethod
    def freezer(leaves: list[str]) -> str | None:
        """The leaf among these that can freeze its processes: a cgroup v2 one (``cgroup.freeze``,
        Linux 5.2); None where every leaf is v1."""
        return next((leaf for leaf in leaves if os.path.exists(os.path.join(leaf, "cgroup.freeze"))), None)

    @staticmethod
    def set_frozen(leaf: str, frozen: bool, timeout: float = FREEZE_WAIT) -> None:
        """Freeze (or thaw) every process of a v2 leaf and wait until the kernel says it is done
        (``cgroup.events``: ``frozen 1``); a frozen process keeps its state and takes no CPU, and
        nothing in it can tell (no signal, no EINTR). Raises CgroupError past ``timeout``."""
        want = "1" if frozen else "0"
        with open(os.path.join(leaf, "cgroup.freeze"), "w") as f:
            f.write(want)
        events = os.path.join(leaf, "cgroup.events")
        deadline = time.monotonic() + timeout
        with open(events) as f:
            poller = select.poll()
            poller.register(f, select.POLLPRI)  # kernfs wakes pollers when cgroup.events changes
            while True:
                f.seek(0)
                state = dict(line.split() for line in f.read().splitlines() if line.strip())
                if state.get("frozen") == want:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CgroupError(errno.ETIMEDOUT, f"{leaf} did not {'freeze' if frozen else 'thaw'} "
                                                       f"within {timeout:g} s")
                poller.poll(min(left, 0.05) * 1000)

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
        """Remove these leaves: the empty ones now, the others once their last process has exited
        (a retired sandbox's reaper goes after its last fork; a killed process once the kernel has
        torn it down), by the janitor. Returns those still busy now."""
        busy = [leaf for leaf in leaves if not _removed(leaf)]
        if busy:
            self.janitor.add(busy)
        return busy

    def sweep(self) -> None:
        """Remove every empty leaf of ours (left behind by sandboxes that ended on their own)."""
        for controller in CONTROLLERS:
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

    def close(self) -> None:
        """The engine stops: remove our empty leaves and, if none is left, our group (sandboxes outlive
        the server, so leaves that still hold processes stay, and the janitor keeps watching them
        while this process lives; the next engine on the data dir sweeps what it missed). Leaves
        given up just before (a reaper whose last fork was just deleted) have ``CLOSE_WAIT`` s to empty."""
        self.janitor.idle.wait(CLOSE_WAIT)
        self.sweep()
        for controller in CONTROLLERS:
            where = locate(controller)
            if where is not None:
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(where[1], self.group))


CLOSE_WAIT = 2.0     # s a closing engine gives the janitor to remove leaves whose processes are exiting
JANITOR_RETRY = 1.0  # s between tries of a leaf whose rmdir fails though no process is left in it
JANITOR_TRIES = 30   # such tries before it is left to the next sweep


class Janitor:
    """Removes leaves that still held processes when they were given up, once those have exited.

    One thread, started when there is work and ending when there is none: it tries each leaf, then
    waits on the pidfds of the processes left in them (no polling while they live), and tries again
    when one exits or a leaf is added. ``idle`` is set while nothing waits for removal."""

    def __init__(self) -> None:
        self._pending: dict[str, int] = {}  # leaf -> tries while it had no process yet stayed
        self._lock = threading.Lock()
        self._wake: tuple[int, int] | None = None  # the running thread's wake-up pipe
        self.idle = threading.Event()
        self.idle.set()

    def add(self, leaves: list[str]) -> None:
        with self._lock:
            for leaf in leaves:
                self._pending.setdefault(leaf, 0)
            self.idle.clear()
            if self._wake is None:
                self._wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
                threading.Thread(target=self._run, args=(self._wake[0],), name="forkd-cgroup-janitor",
                                 daemon=True).start()
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake[1], b"x")

    def _run(self, wake: int) -> None:
        while True:
            with self._lock:
                leaves = list(self._pending)
            pids: set[int] = set()
            emptied = False
            for leaf in leaves:
                if not _removed(leaf):
                    held = Cgroups.procs(leaf)
                    pids.update(held)
                    if held:
                        continue
                    with self._lock:
                        self._pending[leaf] += 1
                        if self._pending[leaf] < JANITOR_TRIES:
                            emptied = True  # no process, yet busy (the kernel still tears one down)
                            continue
                with self._lock:
                    self._pending.pop(leaf, None)
            with self._lock:
                if not self._pending:
                    for fd in self._wake:
                        os.close(fd)
                    self._wake = None
                    self.idle.set()
                    return
            self._wait(wake, pids, JANITOR_RETRY if emptied or not pids else None)

    @staticmethod
    def _wait(wake: int, pids: set[int], timeout: float | None) -> None:
        """Until one of ``pids`` exits, a leaf is added, or ``timeout``."""
        fds = []
        for pid in pids:
            with contextlib.suppress(OSError):
                fds.append(os.pidfd_open(pid))
        if not fds and timeout is None:
            timeout = JANITOR_RETRY  # they exited before we could watch them: look again soon
        try:
            waiter = select.poll()
            waiter.register(wake, select.POLLIN)
            for fd in fds:
                waiter.register(fd, select.POLLIN)
            waiter.poll(None if timeout is None else int(timeout * 1000))
            with contextlib.suppress(BlockingIOError):
                os.read(wake, 4096)
        finally:
            for fd in fds:
                os.close(fd)
