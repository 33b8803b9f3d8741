"""A sandbox the notebook runs in is the notebook's, wherever it was made.

A checkout may move the notebook into a sandbox it did not make: forked from the lineage panel, by
the CLI, with another memory limit. Once HEAD, it gets what the notebook's own sandboxes get:

- the notebook's labels (``jupyter.notebook`` / ``jupyter.kernel_id``), so that after a kernel
  restart, when it is no longer HEAD, ``%forkd kill --all`` still finds it among this notebook's;
- at least the notebook's memory limit (docs/design/kernel.md, "The notebook's memory limit"): the
  pages the notebook shares with the branches it keeps stay charged to it, so a notebook of 1 GiB in
  a sandbox of the server's default 2 GiB dies of its huge-page cap at the second rewrite.

Both are one ``PATCH /v1/sandboxes/{id}``. A limit is never lowered; one the server cannot raise is
said as a warning, since a cell that needs more than it would end the sandbox.
"""

from __future__ import annotations

from forkd_server.client import ControllerError, ServerUnreachable

__all__ = ["make_ours"]


def make_ours(controller, info: dict, labels: dict[str, str], memory_limit_mib: int | str | None) -> list[str]:
    """Give the sandbox ``info`` describes the notebook's labels and memory limit (MiB, or ``"host"``:
    all of its host's memory, which the server resolves); returns the lines to tell the user (empty
    when it had both already)."""
    sandbox, limit = info["id"], info.get("memory_limit_mib")
    missing = {k: v for k, v in labels.items() if (info.get("labels") or {}).get(k) != v}
    # None: no limit to raise (a VM started without one); a higher one stays as it is, and "host" is
    # raised by the server only where the sandbox has less than its host's memory
    if limit is None or not memory_limit_mib:
        raise_to = None
    elif memory_limit_mib == "host":
        raise_to = "host"
    else:
        raise_to = memory_limit_mib if limit < memory_limit_mib else None
    if not missing and raise_to is None:
        return []
    wanted = "all of its host's memory" if raise_to == "host" else f"{memory_limit_mib} MiB"
    try:
        after = controller.update_sandbox(sandbox, labels=missing or None, memory_limit_mib=raise_to)
    except (ControllerError, ServerUnreachable) as exc:
        if raise_to is None:
            return [_unlabelled(sandbox, exc)]
        said = [(f"forkd: warning: {sandbox} keeps its memory limit of {limit} MiB, lower than this notebook's "
                 f"({wanted}): the server could not raise it ({_why(exc)}). A cell that needs more ends "
                 f"the sandbox; %forkd fork -n 1 makes a copy of the notebook with the notebook's limit.")]
        if missing:  # the labels alone may still go through
            try:
                controller.update_sandbox(sandbox, labels=missing)
            except (ControllerError, ServerUnreachable) as again:
                said.append(_unlabelled(sandbox, again))
        return said
    now = (after or {}).get("memory_limit_mib")
    if raise_to is not None and isinstance(now, int) and now > limit:
        return [(f"forkd: {sandbox} had a memory limit of {limit} MiB, lower than this notebook's: raised to "
                 f"{now} MiB (its /tmp and /dev/shm keep their sizes).")]
    return []


def _why(exc: Exception) -> str:
    return getattr(exc, "message", None) or str(exc)


def _unlabelled(sandbox: str, exc: Exception) -> str:
    return (f"forkd: warning: {sandbox} could not be labelled as this notebook's ({_why(exc)}): after a kernel "
            f"restart, %forkd kill --all will not find it; %forkd kill {sandbox} will.")
