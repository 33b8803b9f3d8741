"""Creating snapshots from setup code, within limits, and cancelling a creation.

A snapshot's setup is user code like any sandbox's, so it runs within a sandbox's limits: memory
(``memory_limit_mib``, else the engine's default), pids, and time (``setup_timeout_secs``, the
whole creation, start-up included; 600 s unless asked). Every number of the request is bounded
(checks.py) with a 400 that states the bound. ``DELETE`` of a snapshot being created cancels it:
the engine stops the setup, the create call answers 409 saying so, and nothing of it stays.
A setup that leaves running work is refused (409) unless ``lossy``; a lossy one's snapshot keeps
what its children lack as ``warnings``.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from forkd_engine import Cancelled, EngineError, InvalidSpec, LimitReached, LossyFork, SnapshotSpec

from .branching import lossy_refusal
from .checks import ENGINES, check_disk_mib, check_labels, check_memory_mib, check_setup_timeout, check_tag, memory_limit
from ..errors import BadRequest, Conflict, EngineFailure, ForkdError
from .setup_failures import setup_refusal

if TYPE_CHECKING:
    from .controller import Controller

DEFAULT_SETUP_TIMEOUT_SECS = 600.0
CANCEL_TIMEOUT = 60.0  # how long a DELETE waits for the creation it cancelled to end
# The guest's kernel and Python run out of memory below this at boot (160 MiB was the least that
# booted here, 128 panicked); a smaller guest is the request's mistake, not a failed engine.
VM_MIN_MIB = 192


class CreationManager:
    def __init__(self, controller: "Controller"):
        self.ctl = controller
        self.registry = controller.registry
        self.feed = controller.feed
        self._lock = threading.Lock()
        self._running: dict[str, dict] = {}  # tag -> {"engine", "ended": Event, "cancelled": bool}

    def create(self, tag, *, engine: str = "auto", setup: str | None = None, setup_commands: list | None = None,
               mem_size_mib: int | None = None, host_network: bool = False, disk_mib: int | None = None,
               packages: list[str] | None = None, lossy: bool = False, shell: str = "plain",
               labels: dict | None = None, setup_timeout_secs: float | None = None,
               memory_limit_mib: int | None = None) -> dict:
        check_tag(tag)
        if engine not in ENGINES:
            raise BadRequest(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        if shell not in ("plain", "ipython"):
            raise BadRequest(f"shell must be plain or ipython, got {shell!r}")
        labels = check_labels(labels)
        if setup is not None and not isinstance(setup, str):
            raise BadRequest("setup must be a string of Python code")
        commands = setup_commands or []
        if not isinstance(commands, list) or not all(
                isinstance(c, list) and c and all(isinstance(a, str) for a in c) for c in commands):
            raise BadRequest("setup_commands must be a list of argv lists, e.g. [[\"pip\", \"install\", \"x\"]]")
        if mem_size_mib is not None:
            check_memory_mib(mem_size_mib, "mem_size_mib", VM_MIN_MIB)
        memory_limit_mib = memory_limit(memory_limit_mib)
        if disk_mib is not None:
            check_disk_mib(disk_mib, self.ctl.data_dir)
        timeout = DEFAULT_SETUP_TIMEOUT_SECS if setup_timeout_secs is None else check_setup_timeout(setup_timeout_secs)
        if packages:
            from forkd_engine.vm.packages import PackageNotFound, validate_packages
            try:
                packages = validate_packages(packages)
            except PackageNotFound as exc:
                raise BadRequest(str(exc)) from None
        packages = list(packages or [])
        if engine == "auto" and (packages or disk_mib is not None):
            engine = "vm"  # what was asked for exists only in a VM guest (as forkd's kernel/rootfs form)
        name, eng = self.ctl._engine(engine)
        if disk_mib is not None and name != "vm":
            raise BadRequest("disk_mib needs engine vm (a process sandbox's files live in its private layer)")
        if packages and name != "vm":
            raise BadRequest("packages need engine vm (a process sandbox runs the host's Python environment)",
                             hint="ask for engine vm, or add the software with setup_commands")
        with self.ctl.branches.reserve(tag, f"snapshot {tag} is already being written"):
            if self.registry.get_snapshot(tag) is not None:
                raise BadRequest(f"snapshot {tag} already exists; DELETE first")
            spec = SnapshotSpec(tag=tag, setup=setup, setup_commands=commands, host_network=bool(host_network),
                                mem_size_mib=mem_size_mib, disk_mib=disk_mib, packages=packages, lossy=bool(lossy),
                                shell=shell, setup_timeout=timeout, memory_limit_mib=memory_limit_mib)
            self.registry.insert_snapshot({
                "tag": tag, "engine": name, "status": "writing", "created_at": time.time(),
                "lineage": [tag], "spec": {"setup": setup, "setup_commands": commands,
                                           "host_network": bool(host_network), "mem_size_mib": mem_size_mib,
                                           "disk_mib": disk_mib, "packages": packages, "shell": shell,
                                           "setup_timeout_secs": timeout, "memory_limit_mib": memory_limit_mib},
                "labels": labels})
            self.feed.emit("snapshot", "created", tag=tag, status="writing")
            running = {"engine": eng, "ended": threading.Event(), "cancelled": False}
            with self._lock:
                self._running[tag] = running
            try:
                if running["cancelled"]:
                    raise Cancelled(f"snapshot {tag!r}: deleted while it was being created")
                handle = eng.create_snapshot(spec)
                with self._lock:  # a cancel from now on finds nothing to cancel
                    self._running.pop(tag, None)
                if running["cancelled"]:  # came after the engine was done: undo it
                    eng.delete_snapshot(handle)
                    raise Cancelled(f"snapshot {tag!r}: deleted while it was being created")
            except EngineError as exc:
                self.registry.delete_snapshot(tag)
                self.feed.emit("snapshot", "deleted", tag=tag)
                if isinstance(exc, Cancelled):
                    raise Conflict(str(exc)) from None
                if isinstance(exc, InvalidSpec):  # its own setup failed, an unknown package...: the request's fault
                    raise setup_refusal(tag, str(exc)) from None
                if isinstance(exc, LossyFork):
                    raise lossy_refusal(exc, f"snapshot {tag}: every sandbox is a fork of it, and its setup",
                                        magic=None) from None
                if isinstance(exc, LimitReached):
                    raise Conflict(f"snapshot {tag}: {exc}") from None
                raise EngineFailure(str(exc)) from exc
            finally:
                with self._lock:
                    self._running.pop(tag, None)
                running["ended"].set()
            # A lossy setup left running work its children lack: the snapshot keeps the list (as a
            # lossy branch does), and the reply carries it.
            lost = list(handle.pop("warnings", None) or [])
            fields, error = self.ctl.branches.settle(
                tag, {"status": "ready", "handle": handle, **({"warnings": lost} if lost else {})}, eng)
            self.feed.emit("snapshot", "status", tag=tag, status=fields["status"],
                           **({"warning": fields["warning"]} if "warning" in fields else {}))
            if error is not None:  # never left writing: failed, its template ended (a full disk: 507)
                raise EngineFailure(f"snapshot {tag}: its setup ran but its record could not be written "
                                    f"({error}); it is failed") from error
            return self.ctl.snapshot_info(self.registry.get_snapshot(tag))

    def cancel(self, tag: str) -> bool:
        """Stop the creation of ``tag`` if one runs, and wait until it has ended (nothing of it
        stays). False when no creation of ``tag`` runs."""
        with self._lock:
            running = self._running.get(tag)
            if running is None:
                return False
            running["cancelled"] = True
        deadline = time.monotonic() + CANCEL_TIMEOUT
        # Until the engine has the creation in hand it cannot stop it: ask again, briefly, until it
        # does or the creation has ended (the flag above stops one not yet handed to the engine).
        while not running["engine"].cancel(tag) and not running["ended"].wait(0.05):
            if time.monotonic() > deadline:
                break
        if not running["ended"].wait(max(0.0, deadline - time.monotonic())):
            raise ForkdError(f"snapshot {tag}: its creation was cancelled but did not end within {CANCEL_TIMEOUT:g} s")
        return True
