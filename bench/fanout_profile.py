"""Where one ``spawn(n)`` spends its time, stage by stage (``bench/fanout.py --profile``).

Host side, the bench wraps the controller's, registry's and engine's steps with timestamps. Inside,
the snapshot's own setup code (``CHILD_PROBE``) wraps the template's and each child's steps the
same way: the template's fork loop answers with its timestamps, each child reports with its own.
Every timestamp is ``time.monotonic()``, one clock for the host and every sandbox (they share the
kernel and have no time namespace). Nothing of this is in the engine: it is the bench's setup code.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

# Runs in the template as part of its setup: it wraps the steps a spawn's fork loop and each child
# take (by module attribute, as the engine calls them), and adds the timestamps to the replies.
CHILD_PROBE = r'''
import time as _time
import forkd_engine.linux as _linux
import forkd_engine.process.inside as _inside
import forkd_engine.agent.children as _children
import forkd_engine.agent.inventory as _inventory
import forkd_engine.agent.runtime as _runtime
_marks = []
_MEMORY = {memory}

def _private_kib():
    if not _MEMORY:
        return 0
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith(("Private_Clean", "Private_Dirty")))

def _wrap(owner, attr, name):
    inner = getattr(owner, attr)
    def wrapped(*args, **kwargs):
        result = inner(*args, **kwargs)
        _marks.append((name, _time.monotonic(), _time.process_time(), _private_kib()))
        return result
    setattr(owner, attr, wrapped)

_raw_fork = _children.raw_fork
_in_child = []
def _fork():
    pid = _raw_fork()
    if not _in_child:
        if pid == 0:  # a new child (its own fork for its init comes next: not marked)
            _in_child.append(True)
            _marks[:] = [("child:forked", _time.monotonic(), _time.process_time(), _private_kib())]
        else:
            _marks.append(("parent:forked", _time.monotonic(), _time.process_time(), _private_kib()))
    return pid
_children.raw_fork = _fork

try:
    import forkd_engine.process.fanout as _fanout
except ImportError:  # an engine before the C loop: its forks go through raw_fork, marked above
    _fanout = None
if _fanout is not None:
    _fork_children = _fanout.fork_children
    def _forking(n, *args):  # the C loop (fanout.c): the template marks its end only
        index, pids = _fork_children(n, *args)
        if index:
            _in_child.append(True)
            _marks[:] = [("child:forked", _time.monotonic(), _time.process_time(), _private_kib())]
        else:
            _marks.extend([("parent:forked", _time.monotonic(), _time.process_time(), _private_kib())] * n)
        return index, pids
    _fanout.fork_children = _forking
for _owner, _attr in ((_inside, "hand_pid1_to_init"), (_inside, "close_agent_fds"), (_linux, "unshare"),
                      (_linux, "mount"), (_inside, "private_copy"), (_linux, "sethostname"),
                      (_inside, "own_machine_id"), (_linux, "loopback_up"), (_inventory, "repair_after_fork"),
                      (_runtime.Runtime, "after_fork"), (_children, "install"), (_inside, "Executor"),
                      (_inside, "Compactor"), (_inside.AgentServer, "start")):
    _wrap(_owner, _attr, getattr(_attr, "__name__", _attr))

_report = _inside.report
def _reporting(fd, message):
    if message.get("ok") and message.get("id", "").startswith("sb-"):
        message = {**message, "t": _marks + [("report", _time.monotonic(), _time.process_time(), _private_kib())]}
    return _report(fd, message)
_inside.report = _reporting

_spawn = _inside.SandboxProcess.spawn
def _spawning(self, request, fds):
    _marks[:] = [("template:request", _time.monotonic(), _time.process_time(), _private_kib())]
    reply = _spawn(self, request, fds)
    return {**reply, "t": _marks + [("template:reply", _time.monotonic(), _time.process_time(), _private_kib())]}
_inside.SandboxProcess.spawn = _spawning
'''


class HostProbe:
    """Timestamps of the host's steps of a spawn: wraps methods of the live objects given."""

    def __init__(self):
        self.spans: list[tuple[str, float, float]] = []
        self.reports: list[dict] = []
        self.template: list = []
        self._undo: list = []

    def wrap(self, owner, attr: str, name: str, keep=None) -> None:
        inner = getattr(owner, attr)

        def wrapped(*args, **kwargs):
            t0 = time.monotonic()
            result = inner(*args, **kwargs)
            self.spans.append((name, t0, time.monotonic()))
            if keep is not None:
                keep(result)
            return result

        setattr(owner, attr, wrapped)
        self._undo.append((owner, attr))

    def attach(self, ctl) -> None:
        engine = ctl.engines["process"]
        reg = ctl.registry

        def keep_report(got):
            if got is not None and "t" in got[0]:
                self.reports.append(got[0])

        def keep_reply(reply):
            if isinstance(reply, dict) and "t" in reply:
                self.template = reply["t"]

        for owner, attr, name, keep in (
                (ctl.sandboxes, "spawn", "controller.spawn", None),
                (reg, "next_counter", "registry: counter", None),
                (reg, "insert_sandboxes", "registry: rows 'starting'", None),
                (reg, "insert_numbered_sandboxes", "registry: numbers and rows 'starting'", None),
                (reg, "set_sandbox_handles", "registry: rows 'running'", None),
                (reg, "get_sandbox", "registry: read rows back", None),
                (engine, "spawn", "engine.spawn", None),
                (engine, "_listen", "engine: bind sockets", None),
                (engine, "call", "engine: spawn request (template forks)", keep_reply),
                (engine, "_read_report", "engine: wait for reports", keep_report),
                (engine, "_handle", "engine: handles (/proc reads)", None),
                (engine.cgroups, "apply", "engine: cgroup leaves", None),
                (engine.cgroups, "prepare", "engine: cgroup leaves made (a thread)", None),
                (engine.cgroups, "join", "engine: cgroup leaves joined", None),
                (ctl.sandboxes, "_agent", "ping (controller)", None),
                (ctl.sandboxes, "row", "ping: registry row + alive", None)):
            if hasattr(owner, attr):
                self.wrap(owner, attr, name, keep)

    def detach(self) -> None:
        for owner, attr in reversed(self._undo):
            delattr(owner, attr)  # the instance attribute goes; the class's method shows again
        self._undo.clear()


def breakdown(probe: HostProbe, t0: float, t_spawned: float, t_pinged: float) -> dict:
    """The profile of one spawn: host stages (sum of their time, and their span), the template's
    fork loop, and each child's stages (median time since the previous stage)."""
    host = defaultdict(lambda: {"calls": 0, "sum_ms": 0.0, "first_ms": None, "last_ms": 0.0})
    for name, a, b in probe.spans:
        h = host[name]
        h["calls"] += 1
        h["sum_ms"] += (b - a) * 1000
        h["first_ms"] = (a - t0) * 1000 if h["first_ms"] is None else h["first_ms"]
        h["last_ms"] = (b - t0) * 1000
    tmpl = probe.template
    forks = [m[1] for m in tmpl if m[0] == "parent:forked"]
    fork_cpu = [m[2] for m in tmpl if m[0] == "parent:forked"]
    template = {}
    if tmpl:
        template = {"request_at_ms": (tmpl[0][1] - t0) * 1000, "reply_at_ms": (tmpl[-1][1] - t0) * 1000,
                    "forks": len(forks),
                    "fork_loop_ms": (forks[-1] - tmpl[0][1]) * 1000 if forks else 0.0,
                    "per_fork_ms": (forks[-1] - tmpl[0][1]) * 1000 / len(forks) if forks else 0.0,
                    "cpu_ms": (tmpl[-1][2] - tmpl[0][2]) * 1000,
                    "per_fork_cpu_ms": (fork_cpu[-1] - tmpl[0][2]) * 1000 / len(forks) if forks else 0.0}
    steps, cpu, mem = defaultdict(list), defaultdict(list), defaultdict(list)
    ends = []
    for rep in probe.reports:
        marks = rep.get("t")
        if not marks:  # reported from the template's C loop, where the child idles: no Python ran in it
            continue
        cpu["child:forked"].append(marks[0][2] * 1000)  # a fork starts at 0 s of CPU
        steps["child:forked"].append((marks[0][1] - tmpl[0][1]) * 1000 if tmpl else 0)
        mem["child:forked"].append(marks[0][3])
        for (_, a, ca, ma), (name, b, cb, mb) in zip(marks, marks[1:]):
            steps[name].append((b - a) * 1000)
            cpu[name].append((cb - ca) * 1000)
            mem[name].append(mb - ma)
        ends.append(marks[-1][1])
    child = {name: {"median_ms": statistics.median(v), "cpu_median_ms": statistics.median(cpu[name]),
                    "cpu_sum_ms": sum(cpu[name]), "private_kib": statistics.median(mem[name]), "count": len(v)}
             for name, v in steps.items()}
    return {"total_ms": (t_pinged - t0) * 1000, "spawn_call_ms": (t_spawned - t0) * 1000,
            "pings_ms": (t_pinged - t_spawned) * 1000,
            "last_report_at_ms": (max(ends) - t0) * 1000 if ends else None,
            "host": dict(host), "template": template, "child": child}


def print_breakdown(prof: dict) -> None:
    last = prof["last_report_at_ms"]
    print(f"spawn until all answered a ping: {prof['total_ms']:.1f} ms (the call {prof['spawn_call_ms']:.1f} ms, "
          f"then the pings {prof['pings_ms']:.1f} ms); "
          + (f"last child reported at {last:.1f} ms" if last is not None else
             "the children reported and answered from the template's C loop (no stamps of theirs)"))
    print("host stages                                      calls   sum ms   from ms    to ms")
    for name, h in sorted(prof["host"].items(), key=lambda kv: kv[1]["first_ms"]):
        print(f"  {name:<46} {h['calls']:>5} {h['sum_ms']:>8.1f} {h['first_ms']:>9.1f} {h['last_ms']:>8.1f}")
    t = prof["template"]
    if t:
        print(f"template: request at {t['request_at_ms']:.1f} ms, {t['forks']} forks in {t['fork_loop_ms']:.1f} ms "
              f"({t['per_fork_ms']:.3f} ms each, CPU {t['per_fork_cpu_ms']:.3f} ms), reply at "
              f"{t['reply_at_ms']:.1f} ms; CPU {t['cpu_ms']:.1f} ms")
    print("child stages (since the previous one)         wall median ms  CPU median ms  CPU sum ms  +private KiB")
    for name, c in prof["child"].items():
        print(f"  {name:<46} {c['median_ms']:>9.3f} {c['cpu_median_ms']:>9.3f} {c['cpu_sum_ms']:>9.1f} "
              f"{c['private_kib']:>9.0f}")
