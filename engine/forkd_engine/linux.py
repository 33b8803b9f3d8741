"""Thin ctypes wrappers over the Linux calls the engines need.

Python 3.10/3.11 has no ``os.unshare``/``os.setns``/``mount``, so these go straight to libc.
Everything here raises ``OSError`` with the real errno, so callers can say what failed and why.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
import platform
import select
import signal
import socket
import struct

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_MOVE = 0x2000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2

_MACHINE = platform.machine()
# Syscalls without a libc wrapper we can rely on, per architecture.
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def mount(source: str | None, target: str, fstype: str | None = None, flags: int = 0,
          data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    ret = _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
    _check(ret, f"mount {fstype or source or ''} on {target}")


def umount(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(target.encode(), ctypes.c_int(flags)), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    nr = _SYS_PIVOT_ROOT.get(_MACHINE)
    if nr is None:
        raise OSError(errno.ENOSYS, f"pivot_root: unsupported architecture {_MACHINE}")
    _check(_libc.syscall(ctypes.c_long(nr), new_root.encode(), put_old.encode()), "pivot_root")


def sethostname(name: str) -> None:
    raw = name.encode()
    _check(_libc.sethostname(raw, ctypes.c_size_t(len(raw))), "sethostname")


def loopback_up() -> None:
    """Bring ``lo`` up in the current network namespace (a new one starts with it down)."""
    SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sh14x", b"lo", 0)
        flags = struct.unpack("16sh14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sh14x", b"lo", flags | IFF_UP))


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it is gone.

    Together with the pid it names one process for good: a reused pid has another start time.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name may contain spaces and parentheses; fields restart after the last ')'.
    fields = stat[stat.rindex(b")") + 2:].split()
    # "Z" is the main thread's state. The process is dead unless another of its threads runs on: a
    # main thread may end before the rest, and an execve from another thread passes through this.
    if fields[0] == b"Z" and not _another_thread_runs(pid):
        return None
    return int(fields[19])


def boot_ticks() -> int:
    """Now, in the unit of ``process_start_time``: clock ticks since boot."""
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` as this process's pid namespace sees it (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[1])


def live_children(pid: int) -> list[int]:
    """The children of ``pid`` that have not exited (zombies left out), from every thread's
    /proc/<pid>/task/<tid>/children."""
    found = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return [c for c in found if process_start_time(c) is not None]


def socket_holders(path: str) -> list[int]:
    """The processes holding a descriptor of the Unix socket bound at ``path`` (in this network
    namespace), found through its inode in /proc/net/unix and every process's fd table: for a socket
    whose process answers nothing on it."""
    inodes = set()
    with contextlib.suppress(OSError), open("/proc/net/unix") as f:
        next(f, None)
        for line in f:
            parts = line.split()
            if len(parts) >= 8 and parts[7] == path:
                inodes.add(f"socket:[{parts[6]}]")
    holders = []
    if not inodes:
        return holders
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(fd.path) in inodes:
                        holders.append(int(entry.name))
                        break
    return holders


def wait_exit(pid: int, start_time: int | None, timeout: float) -> bool:
    """Wait up to ``timeout`` s for the process ``pid`` started at ``start_time`` to exit (on its
    pidfd, which turns readable then); True once it has, or if the pid names another process now."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        started = process_start_time(pid)  # None while it dies: wait for its pidfd all the same
        if started is not None and started != start_time:
            return True  # the pid names another process now
        return wait_pidfd(pidfd, timeout)
    finally:
        os.close(pidfd)


_SYS_PIDFD_GETFD = 438  # the same number on every architecture (Linux 5.6's unified table)


def pidfd_getfd(pidfd: int, fd: int) -> int:
    """A copy, in this process, of descriptor ``fd`` of the process ``pidfd`` names."""
    return _check(_libc.syscall(ctypes.c_long(_SYS_PIDFD_GETFD), pidfd, fd, 0), f"pidfd_getfd of descriptor {fd}")


def wait_pidfd(pidfd: int, timeout: float) -> bool:
    """Wait up to ``timeout`` s for a pidfd to turn readable (its process has exited, every thread).
    poll(), never select(): a server with ~1000 sandboxes has descriptors past 1024."""
    waiter = select.poll()
    waiter.register(pidfd, select.POLLIN)
    return bool(waiter.poll(max(0, int(timeout * 1000))))


PF_EXITING = 0x4                          # task flag: the thread is in do_exit
_SIGKILL_PENDING = 1 << (signal.SIGKILL - 1)


def _another_thread_runs(pid: int) -> bool:
    """Whether a thread of ``pid`` other than its main one lives and is not on its way out (not
    exiting, no SIGKILL pending: a killed process's threads take a moment to go)."""
    try:
        tids = [t for t in os.listdir(f"/proc/{pid}/task") if t != str(pid)]
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                pending = next(int(line.split()[1], 16) for line in f if line.startswith("SigPnd:"))
        except (OSError, StopIteration, ValueError):
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        if fields[0] not in (b"Z", b"X") and not int(fields[6]) & PF_EXITING and not pending & _SIGKILL_PENDING:
            return True
    return False


def write_id_maps(pid: int, uid: int, gid: int, proc_fd: int) -> None:
    """Map root inside ``pid``'s new user namespace to ``uid``/``gid`` outside it.

    ``proc_fd`` is an open directory fd of the host's /proc (the caller may have pivoted away).
    """
    for name, host_id in (("uid_map", uid), ("gid_map", gid)):
        fd = os.open(f"{pid}/{name}", os.O_WRONLY, dir_fd=proc_fd)
        try:
            os.write(fd, f"0 {host_id} 1\n".encode())
        finally:
            os.close(fd)


# --- seccomp -------------------------------------------------------------------------------------

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}

# Host-affecting or attack-surface syscalls a sandbox never needs. Namespaced mount/unshare stay
# allowed (the agent needs them to give each fork its own /proc and /tmp), except the variants that
# could uncover a covered mount or create a nested user namespace.
_DENIED = {
    "x86_64": {
        "reboot": 169, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175,
        "finit_module": 313, "delete_module": 176, "swapon": 167, "swapoff": 168, "acct": 163,
        "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159,
        "iopl": 172, "ioperm": 173, "syslog": 103, "quotactl": 179, "lookup_dcookie": 212,
        "open_by_handle_at": 304, "name_to_handle_at": 303, "bpf": 321, "perf_event_open": 298,
        "userfaultfd": 323, "keyctl": 250, "add_key": 248, "request_key": 249, "umount2": 166,
        "pivot_root": 155, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "mount_setattr": 442, "io_uring_setup": 425,
        "uselib": 134, "vhangup": 153,
    },
    "aarch64": {
        "reboot": 142, "kexec_load": 104, "kexec_file_load": 294, "init_module": 105,
        "finit_module": 273, "delete_module": 106, "swapon": 224, "swapoff": 225, "acct": 89,
        "settimeofday": 170, "clock_settime": 112, "clock_adjtime": 266, "adjtimex": 171,
        "syslog": 116, "quotactl": 60, "lookup_dcookie": 18, "open_by_handle_at": 265,
        "name_to_handle_at": 264, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
        "keyctl": 219, "add_key": 217, "request_key": 218, "umount2": 39, "pivot_root": 41,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
        "fspick": 433, "mount_setattr": 442, "io_uring_setup": 425, "vhangup": 58,
    },
}
# (syscall number, index of the flags argument, forbidden bits)
_FLAG_RULES = {
    "x86_64": [(165, 3, MS_MOVE), (272, 0, CLONE_NEWUSER), (56, 0, CLONE_NEWUSER)],
    "aarch64": [(40, 3, MS_MOVE), (97, 0, CLONE_NEWUSER), (220, 0, CLONE_NEWUSER)],
}
# Huge-page mappings, refused where the host cannot cap them per sandbox (cgroups.py): mmap's
# MAP_HUGETLB, memfd_create's MFD_HUGETLB, shmget's SHM_HUGETLB.
_HUGETLB_RULES = {
    "x86_64": [(9, 3, 0x40000), (319, 1, 0x4), (29, 2, 0o4000)],
    "aarch64": [(222, 3, 0x40000), (279, 1, 0x4), (194, 2, 0o4000)],
}
# clone3 passes flags in memory that a filter cannot read: answer ENOSYS so libc falls back to clone.
_CLONE3 = 435
# Calls that signal a process named by number, which the guard (process/init.c) answers: a sandbox
# may signal its own pid namespace, not the branches nested in it. (syscall number, index of the pid
# argument.) 0 and negative numbers (groups) pass without a look, but kill(-1): everything.
_SIGNAL_CALLS = {
    "x86_64": {"kill": (62, 0), "rt_sigqueueinfo": (129, 0), "tgkill": (234, 0),
               "rt_tgsigqueueinfo": (297, 0), "tkill": (200, 0)},
    "aarch64": {"kill": (129, 0), "rt_sigqueueinfo": (138, 0), "tgkill": (131, 0),
                "rt_tgsigqueueinfo": (240, 0), "tkill": (130, 0)},
}
# fcntl(F_SETOWN) of a pid > 0 is sent to the guard too (SIGIO and SIGURG, or any signal F_SETSIG
# names, then reach that process); F_SETOWN_EX and the ioctls that set an owner pass it in memory the
# filter cannot read, and are refused. pidfd_send_signal names a descriptor, which the guard cannot
# look into: it answers ENOSYS, as on a kernel before 5.1, and callers fall back to kill.
_FCNTL, _IOCTL, _PIDFD_SEND_SIGNAL = {"x86_64": (72, 16, 424), "aarch64": (25, 29, 424)}.get(
    _MACHINE, (-1, -1, -1))
F_SETOWN, F_SETOWN_EX, FIOSETOWN, SIOCSPGRP = 8, 15, 0x8901, 0x8902
_SECCOMP = {"x86_64": 317, "aarch64": 277}

SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_USER_NOTIF = 0x7FC00000
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06


def seccomp_supported() -> bool:
    return _MACHINE in _DENIED


def seccomp_program(deny_hugetlb: bool = False, guard: bool = False) -> list[tuple[int, int, int, int]]:
    """The BPF filter as (code, jt, jf, k) tuples; a deny answers EPERM. ``deny_hugetlb``: huge-page
    mappings too (a host whose cgroups cannot cap them per sandbox). ``guard``: signal calls that
    name a process go to the filter's listener (``_SIGNAL_CALLS``)."""
    if not seccomp_supported():
        raise OSError(errno.ENOSYS, f"no seccomp syscall table for architecture {_MACHINE}")
    deny = SECCOMP_RET_ERRNO | errno.EPERM
    prog: list[tuple[int, int, int, int]] = []
    # Wrong architecture (e.g. 32-bit int 0x80 entry) or x32 ABI: deny outright.
    prog += [(_LD_W_ABS, 0, 0, 4), (_JEQ, 1, 0, _AUDIT_ARCH[_MACHINE]), (_RET, 0, 0, deny),
             (_LD_W_ABS, 0, 0, 0)]
    if _MACHINE == "x86_64":
        prog += [(_JGE, 0, 1, 0x40000000), (_RET, 0, 0, deny)]
    prog += [(_JEQ, 0, 1, _CLONE3), (_RET, 0, 0, SECCOMP_RET_ERRNO | errno.ENOSYS)]
    for nr in sorted(_DENIED[_MACHINE].values()):
        prog += [(_JEQ, 0, 1, nr), (_RET, 0, 0, deny)]
    if guard:
        prog += _signal_rules(deny)
    for nr, arg, bits in _FLAG_RULES[_MACHINE] + (_HUGETLB_RULES[_MACHINE] if deny_hugetlb else []):
        # if nr matches: load low word of the flags argument, deny when any forbidden bit is set
        prog += [(_JEQ, 0, 4, nr), (_LD_W_ABS, 0, 0, 16 + 8 * arg), (_JSET, 0, 1, bits),
                 (_RET, 0, 0, deny), (_RET, 0, 0, SECCOMP_RET_ALLOW)]
    prog.append((_RET, 0, 0, SECCOMP_RET_ALLOW))
    return prog


def _signal_rules(deny: int) -> list[tuple[int, int, int, int]]:
    """The guard's part of the filter (each block ends in a return, so a match goes no further)."""
    notify, allow = SECCOMP_RET_USER_NOTIF, SECCOMP_RET_ALLOW
    arg = lambda k: (_LD_W_ABS, 0, 0, 16 + 8 * k)  # noqa: E731 - the low word of argument k
    prog: list[tuple[int, int, int, int]] = []
    for name, (nr, index) in _SIGNAL_CALLS[_MACHINE].items():
        minus_one = deny if name in ("kill", "rt_sigqueueinfo") else allow  # kill(-1): all it may signal
        prog += [(_JEQ, 0, 7, nr), arg(index),
                 (_JEQ, 3, 0, 0),                  # 0: its own group
                 (_JEQ, 1, 0, 0xFFFFFFFF),         # -1
                 (_JSET, 1, 2, 0x80000000),        # another negative: a group
                 (_RET, 0, 0, minus_one),
                 (_RET, 0, 0, allow),
                 (_RET, 0, 0, notify)]
    prog += [(_JEQ, 0, 10, _FCNTL), arg(1),
             (_JEQ, 0, 5, F_SETOWN), arg(2),
             (_JEQ, 2, 0, 0), (_JSET, 1, 0, 0x80000000), (_RET, 0, 0, notify),
             (_RET, 0, 0, allow),
             (_JEQ, 0, 1, F_SETOWN_EX), (_RET, 0, 0, deny),
             (_RET, 0, 0, allow)]
    prog += [(_JEQ, 0, 5, _IOCTL), arg(1),
             (_JEQ, 1, 0, FIOSETOWN), (_JEQ, 0, 1, SIOCSPGRP), (_RET, 0, 0, deny),
             (_RET, 0, 0, allow)]
    prog += [(_JEQ, 0, 1, _PIDFD_SEND_SIGNAL), (_RET, 0, 0, SECCOMP_RET_ERRNO | errno.ENOSYS)]
    return prog


def install_seccomp(deny_hugetlb: bool = False, guard: bool = False) -> int | None:
    """Install the sandbox filter on the calling thread and every future child (irreversible).
    With ``guard``, the filter sends signal calls to a listener, whose descriptor is returned:
    whoever holds it must answer them (``process/init.c``), or they fail with ENOSYS."""
    PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
    SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER = 1, 1 << 3

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                    ("k", ctypes.c_uint)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    prog = seccomp_program(deny_hugetlb, guard)
    filters = (SockFilter * len(prog))(*[SockFilter(*ins) for ins in prog])
    fprog = SockFprog(len(prog), filters)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    if guard:
        return _check(_libc.syscall(ctypes.c_long(_SECCOMP[_MACHINE]), SECCOMP_SET_MODE_FILTER,
                                    SECCOMP_FILTER_FLAG_NEW_LISTENER, ctypes.byref(fprog)),
                      "seccomp(SECCOMP_FILTER_FLAG_NEW_LISTENER) (Linux 5.5 or later)")
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0),
           "prctl(SECCOMP)")
    return None


def collapse_anonymous_memory(stop=None, chunk: int = 2 << 20) -> int:
    """Re-form huge pages in this process's private anonymous memory (MADV_COLLAPSE, Linux 6.1+).

    Copy-on-write splits huge pages into 4 KiB ones, and fork() then copies 512 times more page-table
    entries. Collapsing first (while the process keeps running) makes the next fork's freeze
    proportional to memory / 2 MiB. Returns the bytes it was asked to cover; best effort. Works in
    ``chunk``-sized steps and returns early once ``stop()`` is true (a branch that cannot wait).
    """
    MADV_COLLAPSE, HUGE = 25, 2 << 20
    covered = 0
    with open("/proc/self/maps") as f:
        regions = f.read().splitlines()
    for line in regions:
        parts = line.split()
        # private, writable, anonymous (no file, or the heap)
        if len(parts) < 5 or parts[1][:2] != "rw" or parts[1][3] != "p" or parts[4] != "0":
            continue
        if len(parts) > 5 and parts[5] != "[heap]":
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        lo, hi = (lo + HUGE - 1) & ~(HUGE - 1), hi & ~(HUGE - 1)
        for start in range(lo, hi, chunk):
            if stop is not None and stop():
                return covered
            size = min(chunk, hi - start)
            _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(size), MADV_COLLAPSE)
            covered += size
    return covered


def set_parent_death_signal(sig: int) -> None:
    PR_SET_PDEATHSIG = 1
    _check(_libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0), "prctl(PDEATHSIG)")


def smaps_rollup(pid: int | str = "self") -> dict[str, int]:
    """/proc/<pid>/smaps_rollup as {field: KiB} (Rss, Pss, Anonymous, Private_Hugetlb...)."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            value = rest.split()
            if len(value) == 2 and value[1] == "kB":  # the first line names the range, not a field
                out[key] = int(value[0])
    return out


def memory_figures(rollup: dict[str, int]) -> dict:
    """Rss, Pss and USS (Private_Clean + Private_Dirty) in KiB, from ``smaps_rollup``."""
    return {"rss_kib": rollup.get("Rss", 0), "pss_kib": rollup.get("Pss", 0),
            "uss_kib": rollup.get("Private_Clean", 0) + rollup.get("Private_Dirty", 0)}


def smaps_memory(pid: int) -> dict:
    """Rss, Pss and USS (Private_Clean + Private_Dirty) of one process, in KiB."""
    return memory_figures(smaps_rollup(pid))
