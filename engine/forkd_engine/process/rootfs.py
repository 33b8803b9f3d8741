"""The read-only root a process sandbox sees.

Built by the bootstrap while it is still the host's root, in a private mount namespace: a tmpfs
holding read-only binds of the system and Python directories, a minimal /dev, and nothing else.
After ``pivot_root`` the host's tree is detached, so the server's data directory (tokens, the
registry, other sandboxes' sockets) is not reachable from inside. Once the sandbox enters its own
user namespace these mounts are locked: code inside cannot unmount them to look underneath.

Code on an import path under a directory every sandbox mounts its own (a checkout in /tmp) is bound
at the same path below ``CODE_ROOT`` instead, and the sandbox's import paths name it there.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

from .. import linux
from .sandbox_init import IN_SANDBOX

_RO = linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NODEV
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_NEVER_BOUND = ("/proc", "/sys", "/dev", "/tmp", "/run")
_SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
CODE_ROOT = "/.forkd-code"  # where code from under the _NEVER_BOUND directories appears


def _under(path: str, dirs) -> bool:
    return any(path == d or path.startswith(d + "/") for d in dirs)


def check_python_location() -> None:
    """Refuse an interpreter the sandbox could not see at its own path (/tmp, /proc, ... are the
    sandbox's own, and ``sys.executable``, ``sys.prefix`` must hold inside as they do outside), and
    forkd's code where the sandbox's uid may not read it."""
    for path in (sys.prefix, sys.base_prefix, sys.executable, os.path.realpath(sys.executable)):
        if _under(os.path.realpath(path) if path != sys.executable else os.path.abspath(path), _NEVER_BOUND):
            raise RuntimeError(
                f"the Python environment at {path} lies under {', '.join(_NEVER_BOUND)}, which every "
                f"sandbox replaces with its own; make the environment elsewhere (e.g. python3 -m venv "
                f"~/forkd-venv); the checkout itself may stay where it is")
    # The agent imports parts of forkd_engine lazily (the IPython shell), as the sandbox's uid:
    # every directory from the bound one down to the package must let others in.
    package = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    top = next((d for d in python_dirs() if _under(package, [d])), package)
    path = package
    while _under(path, [top]):
        mode = os.stat(path).st_mode & 0o777
        if mode & 0o005 != 0o005:
            raise RuntimeError(f"forkd's code at {package} cannot be read inside a sandbox: {path} is mode "
                               f"{mode:o}, closed to other users (the sandbox's uid); run chmod o+rx {path}")
        path = os.path.dirname(path)


def sandbox_path(path: str) -> str:
    """Where an import path appears inside a sandbox: at its own path, or below CODE_ROOT when it
    lies under a directory every sandbox mounts its own (never that directory itself)."""
    real = os.path.realpath(path)
    if _under(real, _NEVER_BOUND) and real not in _NEVER_BOUND:
        return CODE_ROOT + real
    return path


def python_dirs() -> list[str]:
    """Host directories the interpreter needs: prefixes and every import path, outermost first
    (each is bound at ``sandbox_path`` of itself)."""
    candidates = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                  os.path.dirname(os.path.realpath(sys.executable))}
    candidates.update(p for p in sys.path if p)
    dirs = set()
    for path in candidates:
        real = os.path.realpath(path)
        # The root itself (a cwd entry on sys.path) and the sandbox's own mount points are never bound.
        if real == "/" or real in _NEVER_BOUND:
            continue
        if os.path.isdir(real):
            dirs.add(real)
    # Keep only outermost directories, and skip what the system binds already cover.
    out: list[str] = []
    for d in sorted(dirs, key=len):
        if any(d == o or d.startswith(o.rstrip("/") + "/") for o in out + list(_SYSTEM_DIRS)):
            continue
        out.append(d)
    return out


def _follow_moved_code(moved: list[str]):
    """What to call after the pivot so that this process's import path, and the packages and
    modules it imported from ``moved`` (host directories bound below CODE_ROOT), name the code
    where the sandbox sees it. Resolved now, while the host's tree is still there."""

    def renamed(path) -> str | None:
        if isinstance(path, str) and moved:
            real = os.path.realpath(path)
            if _under(real, moved):
                return CODE_ROOT + real
        return None

    modules = list(sys.modules.values())
    lists = [(search, [renamed(p) or p for p in search])
             for search in [sys.path] + [_attr(m, "__path__") for m in modules]
             if isinstance(search, list) and any(renamed(p) for p in search)]
    attrs = [(owner, name, renamed(_attr(owner, name))) for m in modules
             for owner, name in ((m, "__file__"), (_attr(m, "__spec__"), "origin"), (_attr(m, "__loader__"), "path"))
             if renamed(_attr(owner, name))]

    def follow() -> None:
        for search, new in lists:  # a package's __path__: where its submodules are imported from
            search[:] = new
        for owner, name, new in attrs:  # what tracebacks and resource readers open
            with contextlib.suppress(AttributeError, TypeError):
                setattr(owner, name, new)
        importlib.invalidate_caches()

    return follow


def _attr(obj, name: str):
    try:
        return getattr(obj, name, None)
    except Exception:  # noqa: BLE001 - a lazy module may raise anything for a missing name
        return None


def _bind_ro(src: str, dst: str) -> None:
    linux.mount(src, dst, None, linux.MS_BIND)
    linux.mount(None, dst, None, linux.MS_REMOUNT | linux.MS_BIND | _RO)


def build_and_enter(new_root: str, hidden: list[str], init: str) -> None:
    """Build the sandbox root at ``new_root`` (an empty directory) and pivot into it.

    ``hidden`` lists host paths (the data directory) that must stay invisible even when they sit
    under a directory that is bound in. ``init`` (forkd-init, built in forkd's cache: sandbox_init.py) is
    bound read-only at ``/forkd-init``.
    """
    linux.unshare(linux.CLONE_NEWNS)
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    linux.mount("forkd-root", new_root, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "mode=755,size=16m")

    def inside(path: str) -> str:
        return os.path.join(new_root, path.lstrip("/"))

    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            os.symlink(os.readlink(d), inside(d))
        elif os.path.isdir(d):
            os.makedirs(inside(d))
            _bind_ro(d, inside(d))
    dirs = python_dirs()
    for d in dirs:
        os.makedirs(inside(sandbox_path(d)), exist_ok=True)
        _bind_ro(d, inside(sandbox_path(d)))
    follow = _follow_moved_code([d for d in dirs if sandbox_path(d) != d])
    open(inside(IN_SANDBOX), "w").close()
    _bind_ro(init, inside(IN_SANDBOX))
    for h in hidden:
        real = os.path.realpath(h)
        if os.path.isdir(inside(sandbox_path(real))):
            linux.mount("forkd-hidden", inside(sandbox_path(real)), "tmpfs", _RO, "size=4k,mode=000")

    os.makedirs(inside("/sys"))
    linux.mount("/sys", inside("/sys"), None, linux.MS_BIND)
    linux.mount(None, inside("/sys"), None, linux.MS_REMOUNT | linux.MS_BIND | _RO | linux.MS_NOEXEC)

    dev = inside("/dev")
    os.makedirs(dev)
    linux.mount("forkd-dev", dev, "tmpfs", linux.MS_NOSUID | linux.MS_NOEXEC, "mode=755,size=64k")
    for name in _DEVICES:
        if os.path.exists(f"/dev/{name}"):
            open(os.path.join(dev, name), "w").close()
            linux.mount(f"/dev/{name}", os.path.join(dev, name), None, linux.MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, os.path.join(dev, name))
    os.makedirs(os.path.join(dev, "shm"))
    linux.mount(None, dev, None, linux.MS_REMOUNT | linux.MS_NOSUID | linux.MS_NOEXEC | linux.MS_RDONLY)

    for d in ("/proc", "/tmp", "/root", "/home", "/run", "/var"):
        os.makedirs(inside(d), exist_ok=True)
    # The kernel lets a user namespace mount a new /proc only where a proc is already fully
    # visible. The sandbox covers this one with its own at once; being locked, it can't be uncovered.
    linux.mount("/proc", inside("/proc"), None, linux.MS_BIND | linux.MS_REC)
    os.symlink("/tmp", inside("/var/tmp"))

    old = inside("/.old-root")
    os.makedirs(old)
    os.chdir(new_root)
    linux.pivot_root(".", ".old-root")
    os.chdir("/")
    linux.umount("/.old-root", linux.MNT_DETACH)
    os.rmdir("/.old-root")
    linux.mount(None, "/", None, linux.MS_REMOUNT | _RO)
    follow()
