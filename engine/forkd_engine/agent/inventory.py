"""What a ``fork()`` of this process cannot carry, and the repairs that make what it does carry its own.

The process engine copies a sandbox with ``fork()``: memory is copied (copy-on-write) exactly, but
only the forking thread exists in the copy, and kernel objects the process holds open (files,
sockets, shared mappings, event-loop selectors) are *shared* with the source unless the copy
replaces them. ``lost()`` lists, before a fork, what would be left behind or silently shared: other
threads (with the module they were importing), child processes, pending asyncio tasks, the user's
open sockets and pipes, a cell still running. ``repair_after_fork()`` runs first thing in the copy
and gives it its own files, shared memory and event loops; with ``lossy`` it also makes what was
lost fail loudly rather than look fine (a lost process reports that it was killed, never exit 0).

The VM engine copies the whole machine and needs none of this.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import importlib._bootstrap as _bootstrap
import mmap
import os
import socket
import stat
import sys
import threading
import time

AGENT_THREAD_PREFIX = "forkd-"  # the agent's own threads (accept, connections, reaper, flushers)
PRIVATE_DIRS = ("/tmp", "/dev/shm")  # each fork gets its own copy of these

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.memmove.restype = ctypes.c_void_p
_libc.memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
MAP_FAILED = ctypes.c_void_p(-1).value
MAP_FIXED, MREMAP_MAYMOVE, MREMAP_FIXED = 0x10, 1, 2


# --- what a fork leaves behind ----------------------------------------------------------------------

def _describe_thread(t: threading.Thread) -> str:
    target = getattr(t, "_target", None)
    what = getattr(target, "__qualname__", None) or type(t).__name__
    importing = _importing_by(t.ident)
    return (f"thread {t.name!r} ({what}) is running; a fork keeps only the thread that forks"
            + (f", and it is importing {', '.join(importing)}" if importing else ""))


def _importing_by(ident: int | None) -> list[str]:
    names = []
    for name, ref in list(getattr(_bootstrap, "_module_locks", {}).items()):
        lock = ref() if callable(ref) else ref
        if lock is not None and getattr(lock, "owner", None) == ident and getattr(lock, "count", 0):
            names.append(name)
    return names


def other_threads() -> list[threading.Thread]:
    me = threading.current_thread()
    main = threading.main_thread()
    return [t for t in threading.enumerate()
            if t is not me and t is not main and t.is_alive() and not t.name.startswith(AGENT_THREAD_PREFIX)]


def _in_own_pid_ns(pid: str) -> bool:
    """Whether process ``pid`` lives in our pid namespace, not one nested in it (a fork made for a
    branch or a child): its NSpid line, from our namespace down to its own, holds one number.
    /proc/N/status needs no ptrace access, which ``/proc/N/ns/pid`` does: a fork of the agent that
    did not exec keeps memory owned by the host's user namespace, where the sandbox has no
    capability, so a check by that link missed every ``os.fork()``ed process."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return len(line.split()) == 2
    return True  # a kernel without NSpid has no pid namespaces to nest


PF_KTHREAD = 0x00200000  # a kernel thread, in /proc/PID/stat's flags


def user_processes() -> list[tuple[int, str]]:
    """(pid, command) of live processes in this sandbox's pid namespace other than the agent and
    PID 1 (its init, or the agent itself in a VM guest).

    Forks the agent made for branches live in nested pid namespaces and are not listed, nor are
    kernel threads (a VM guest's /proc shows them)."""
    me = os.getpid()
    with open("/proc/self/cmdline", "rb") as f:
        own_cmdline = f.read()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (me, 1):
            continue
        try:
            if not _in_own_pid_ns(name):
                continue
            with open(f"/proc/{name}/stat", "rb") as f:
                stat_line = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                raw = f.read()
            # A fork that did not exec shows our own command line, which would only confuse.
            cmd = "a fork of this Python" if raw == own_cmdline else \
                raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            continue
        fields = stat_line[stat_line.rindex(b")") + 2:].split()
        if fields[0] == b"Z" or int(fields[6]) & PF_KTHREAD:
            continue  # exited, only waiting to be reaped, or the kernel's own: nothing of the user's
        found.append((int(name), cmd[:80] or stat_line[stat_line.index(b"(") + 1:stat_line.rindex(b")")].decode()))
    return sorted(found)


def pending_tasks() -> list[asyncio.Task]:
    tasks = getattr(asyncio.tasks, "_all_tasks", None)
    if tasks is None:
        return []
    return [t for t in list(tasks) if not t.done()]


def _known_loops() -> list[asyncio.AbstractEventLoop]:
    """Event loops this process holds where we can find them: IPython's, the policy's, the tasks'."""
    loops = []
    helpers = sys.modules.get("IPython.core.async_helpers")
    loops.append(getattr(helpers, "_asyncio_event_loop", None))
    policy = asyncio.events._event_loop_policy
    loops.append(getattr(getattr(policy, "_local", None), "_loop", None))
    loops += [t.get_loop() for t in pending_tasks()]
    unique = []
    for loop in loops:
        if loop is not None and not loop.is_closed() and all(loop is not u for u in unique):
            unique.append(loop)
    return unique


def _loop_fds(loop) -> set[int]:
    fds = set()
    for obj in (getattr(loop, "_selector", None), getattr(loop, "_ssock", None), getattr(loop, "_csock", None)):
        with contextlib.suppress(Exception):
            if obj is not None and obj.fileno() >= 0:
                fds.add(obj.fileno())
    return fds


def _accepted_from(fd: int, address) -> bool | None:
    """Whether socket ``fd`` bears ``address`` as its own (a connection accepted from the listener
    bound to it); None if ``fd`` was closed since it was listed (a connection that just ended)."""
    try:
        dup = os.dup(fd)  # from here on the socket cannot go away under us
    except OSError:
        return None
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return False
    with sock:
        try:
            return sock.getsockname() == address
        except OSError:
            return False


def _descriptors() -> dict[int, str]:
    """Every open descriptor of this process: fd -> what /proc says it is."""
    out = {}
    with os.scandir("/proc/self/fd") as it:
        for entry in it:
            with contextlib.suppress(OSError):
                out[int(entry.name)] = os.readlink(entry.path)
    return out


def connections_to(address) -> set[int]:
    """Descriptors of the connections accepted from the listener bound to ``address``: each bears
    the listener's address as its own, from the moment it is accepted."""
    if not address:
        return set()
    return {fd for fd, target in _descriptors().items()
            if target.startswith("socket:") and _accepted_from(fd, address)}


def open_descriptors(agent_fds: set[int], agent_address=None) -> dict[int, str]:
    """The user's open descriptors other than 0-2: fd -> what /proc says it is.

    ``agent_address``, the agent listener's address: a connection accepted from it is the agent's
    (a request the API is sending), also in the moment before the thread serving it has recorded
    it in ``agent_fds``, and so is one closed since it was listed (it ended meanwhile)."""
    return {fd: target for fd, target in _descriptors().items()
            if fd > 2 and fd not in agent_fds
            and not (agent_address and target.startswith("socket:")
                     and _accepted_from(fd, agent_address) is not False)}


def _is_shared_kernel_object(target: str) -> bool:
    return target.startswith(("socket:", "pipe:", "anon_inode:"))


def _shared_mappings() -> list[tuple[int, int, str, int, str]]:
    """Writable shared mappings: (start, end, perms, offset, path) from /proc/self/maps."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 5 or parts[1][1] != "w" or parts[1][3] != "s":
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, parts[1], int(parts[2], 16), parts[5].rstrip("\n") if len(parts) > 5 else ""))
    return out


def _repointable(path: str) -> bool:
    return (not path or path.endswith(" (deleted)") or path.startswith(("/dev/zero", "/SYSV", "[anon_shmem"))
            or any(path == d or path.startswith(d + "/") for d in PRIVATE_DIRS))


def lost(agent_fds: set[int], running: tuple[str, float] | None = None, agent_address=None) -> list[str]:
    """Everything a fork now would not carry, one line a thing (empty: the fork is exact).
    ``agent_address``: see ``open_descriptors``."""
    items = []
    if running is not None:
        ran = time.time() - running[1]
        took = f"{ran:.1f} s" if ran >= 1 else f"{ran * 1000:.0f} ms"
        items.append(f"{running[0]} has been running for {took}: a fork holds the "
                     f"variables as they are at the fork, and the cell does not go on running in it")
    items += [_describe_thread(t) for t in other_threads()]
    procs = user_processes()
    if procs:
        shown = ", ".join(f"{pid} ({cmd})" for pid, cmd in procs[:5])
        items.append(f"{len(procs)} child process{'es' if len(procs) != 1 else ''} running ({shown}"
                     f"{', ...' if len(procs) > 5 else ''}): a fork does not copy processes; in it their "
                     f"Popen objects report them killed")
    tasks = pending_tasks()
    if tasks:
        names = ", ".join(sorted({getattr(t.get_coro(), "__qualname__", "a coroutine") for t in tasks})[:5])
        items.append(f"{len(tasks)} asyncio task{'s' if len(tasks) != 1 else ''} pending ({names}): "
                     f"their I/O waits stay with the source")
    loop_fds: set[int] = set()
    for loop in _known_loops():
        loop_fds |= _loop_fds(loop)
    shared = {fd: t for fd, t in open_descriptors(agent_fds | loop_fds, agent_address).items()
              if _is_shared_kernel_object(t)}
    if shared:
        kinds = ", ".join(sorted({t.split(":")[0] + (":" + t.split(":")[1].strip("[]") if t.startswith("anon_inode") else "")
                                  for t in shared.values()}))
        items.append(f"{len(shared)} open socket{'s' if len(shared) != 1 else ''}, pipe{'s' if len(shared) != 1 else ''} "
                     f"or event descriptor{'s' if len(shared) != 1 else ''} ({kinds}): a fork would share them with "
                     f"the source; in it they are replaced by closed ones")
    for lo, hi, _perms, _off, path in _shared_mappings():
        if not _repointable(path):
            items.append(f"a writable shared mapping of {path} ({(hi - lo) >> 10} KiB) would keep writing into the "
                         f"source's file: only files under {' and '.join(PRIVATE_DIRS)} get their own copy")
    return items


# --- in the copy, first thing ------------------------------------------------------------------------

def fork_plan(agent_fds: set[int]) -> dict:
    """What ``repair_after_fork`` would find in a copy of this process made now: the user's
    descriptors, writable shared mappings and event loops. A template computes it once when it
    parks: no code of the user's runs in it after its setup, so every copy it makes finds the same
    (the agent's own descriptors, which it closes, aside), and no copy need read /proc to learn it."""
    loops = _known_loops()
    loop_fds = set()
    for loop in loops:
        loop_fds |= _loop_fds(loop)
    # The loops too: looking for them walks asyncio's weak set of tasks, Python code each copy would
    # run (and whose objects' pages it would dirty) to find what the template found.
    return {"descriptors": open_descriptors(agent_fds | loop_fds), "mappings": _shared_mappings(),
            "loops": loops}


def repair_after_fork(agent_fds: set[int], lossy: bool, plan: dict | None = None) -> list[str]:
    """Give this fresh fork its own files, shared memory and event loops (call after /tmp and
    /dev/shm are its own copies, and after the agent's descriptors but ``agent_fds`` were closed);
    ``plan``: what ``fork_plan`` found in the parked template this is a copy of, else it is read
    now. Returns notes on what could not be repaired."""
    notes = []
    if plan is None:
        plan = fork_plan(agent_fds)
    for fd, target in plan["descriptors"].items():
        try:
            if target.startswith("/"):
                _reopen_file(fd, target)
            elif _is_shared_kernel_object(target):
                _replace_shared(fd)
        except OSError as exc:
            notes.append(f"descriptor {fd} ({target}): {exc.strerror or exc}")
    for lo, hi, perms, offset, path in plan["mappings"]:
        try:
            _repoint_mapping(lo, hi, perms, offset, path)
        except OSError as exc:
            notes.append(f"shared mapping of {path or 'anonymous memory'}: {exc.strerror or exc}")
    for loop in plan["loops"]:
        _renew_loop(loop)
    _release_import_locks()
    if lossy:
        _fail_lost_work()
    return notes


def _reopen_file(fd: int, path: str) -> None:
    """Point ``fd`` at this fork's own copy of a file under the private dirs (same flags, same offset)."""
    deleted = path.endswith(" (deleted)")
    real = path[:-len(" (deleted)")] if deleted else path
    if not deleted and not any(real == d or real.startswith(d + "/") for d in PRIVATE_DIRS):
        return  # outside the private dirs the file system is read-only: sharing it is harmless
    flags = pos = 0
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "pos":
                pos = int(value)
            elif key == "flags":
                flags = int(value, 8)
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        new = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC * bool(flags & os.O_CLOEXEC))
    elif not stat.S_ISREG(st.st_mode):
        return  # a device or a fifo: nothing of the source's to copy
    elif deleted:
        # An unlinked file (a TemporaryFile) exists only as the source's inode: copy its bytes.
        new = os.open("/tmp", os.O_TMPFILE | os.O_RDWR, 0o600)
        copied = 0
        while copied < st.st_size:
            chunk = os.pread(fd, min(1 << 20, st.st_size - copied), copied)
            if not chunk:
                break
            os.pwrite(new, chunk, copied)
            copied += len(chunk)
    else:
        keep = flags & (os.O_ACCMODE | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC | os.O_SYNC | os.O_DSYNC)
        new = os.open(real, keep)
    try:
        os.lseek(new, pos, os.SEEK_SET)
        os.dup2(new, fd, inheritable=not flags & os.O_CLOEXEC)
    finally:
        os.close(new)


def _replace_shared(fd: int) -> None:
    """A socket, pipe or event fd shared with the source: replace it with one that is closed, so
    using it fails (or reads end-of-file) instead of talking to the source's peer."""
    if stat.S_ISSOCK(os.fstat(fd).st_mode):
        probe = socket.socket(fileno=os.dup(fd))
        family, kind = probe.family, probe.type
        probe.close()  # closes only the duplicate
        fresh = socket.socket(family, kind)  # never connected: send and recv raise ENOTCONN
        try:
            os.dup2(fresh.fileno(), fd)
        finally:
            fresh.close()
        return
    null = os.open("/dev/null", os.O_RDONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def _repoint_mapping(lo: int, hi: int, perms: str, offset: int, path: str) -> None:
    size = hi - lo
    prot = (mmap.PROT_READ if perms[0] == "r" else 0) | (mmap.PROT_WRITE if perms[1] == "w" else 0) \
        | (mmap.PROT_EXEC if perms[2] == "x" else 0)
    real = path[:-len(" (deleted)")] if path.endswith(" (deleted)") else path
    in_private = any(real == d or real.startswith(d + "/") for d in PRIVATE_DIRS)
    if in_private and not path.endswith(" (deleted)"):
        # The file of the same name here is this fork's copy: map it over the same addresses.
        fd = os.open(real, os.O_RDWR if perms[1] == "w" else os.O_RDONLY)
        try:
            got = _libc.mmap(lo, size, prot, mmap.MAP_SHARED | MAP_FIXED, fd, offset)
        finally:
            os.close(fd)
        if got in (None, MAP_FAILED):
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        return
    if path and not _repointable(path):
        return  # refused before the fork unless lossy; nothing to do here
    # Shared anonymous memory (multiprocessing.Value, /dev/zero, SysV, an unlinked file): a fresh
    # shared region with the same bytes, moved over the old addresses.
    got = _libc.mmap(None, size, prot | mmap.PROT_WRITE, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS, -1, 0)
    if got in (None, MAP_FAILED):
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    _libc.memmove(got, lo, size)
    moved = _libc.mremap(got, size, size, MREMAP_MAYMOVE | MREMAP_FIXED, lo)
    if moved in (None, MAP_FAILED):
        err = ctypes.get_errno()
        _libc.munmap(got, size)
        raise OSError(err, os.strerror(err))


def _renew_loop(loop) -> None:
    """An event loop's selector and wake-up socket pair are kernel objects shared with the source:
    give the loop new ones (its timers and ready callbacks are memory, already copied)."""
    import selectors
    if loop.is_running() or not hasattr(loop, "_make_self_pipe"):
        return
    try:
        old = loop._selector
        with contextlib.suppress(Exception):
            old.close()  # closes only our copy of its descriptor: the source keeps its own
        loop._selector = selectors.DefaultSelector()
        for attr in ("_ssock", "_csock"):
            sock = getattr(loop, attr, None)
            if sock is not None:
                with contextlib.suppress(OSError):
                    os.close(sock.detach())
        loop._ssock = loop._csock = None
        loop._make_self_pipe()
    except Exception:  # noqa: BLE001 - an event loop we cannot renew is closed: loud, never shared
        with contextlib.suppress(Exception):
            loop.close()


def _release_import_locks() -> None:
    """Module locks held by threads that do not exist here would hang every later import of those
    modules: free them, and forget the half-imported modules so the next import runs them again."""
    me = threading.get_ident()
    import _thread
    for name, ref in list(getattr(_bootstrap, "_module_locks", {}).items()):
        lock = ref() if callable(ref) else ref
        if lock is None or not getattr(lock, "count", 0) or lock.owner == me:
            continue
        lock.lock, lock.wakeup = _thread.allocate_lock(), _thread.allocate_lock()
        lock.owner, lock.count, lock.waiters = None, 0, 0
        module = sys.modules.get(name)
        spec = getattr(module, "__spec__", None)
        if module is not None and getattr(spec, "_initializing", False):
            del sys.modules[name]
    blocking = getattr(_bootstrap, "_blocking_on", None)
    if isinstance(blocking, dict):
        for tid in [t for t in blocking if t != me]:
            blocking.pop(tid, None)


def _fail_lost_work() -> None:
    """After a lossy fork: what was lost says so when used, instead of looking finished and fine."""
    import concurrent.futures
    import subprocess
    mp_popen = sys.modules.get("multiprocessing.popen_fork")
    popen_types: tuple = (subprocess.Popen,) + ((mp_popen.Popen,) if mp_popen else ())
    lost_error = RuntimeError("lost in the fork: the thread running it does not exist in this copy")
    for obj in gc.get_objects():
        try:
            if isinstance(obj, popen_types):
                if obj.returncode is None:
                    obj.returncode = -9  # as if killed: `check_returncode()` raises, poll() is not 0
            elif isinstance(obj, concurrent.futures.ThreadPoolExecutor):
                obj._threads = set()  # the next submit starts workers again
                obj._idle_semaphore = threading.Semaphore(0)
            elif isinstance(obj, concurrent.futures.Future) and obj.running():
                obj.set_exception(lost_error)
        except Exception:  # noqa: BLE001 - best effort over objects we do not own
            continue
