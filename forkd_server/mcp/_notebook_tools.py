"""The notebook's own tools: what no other sandbox server can do, fork a live notebook.

A notebook on the forkd kernel runs in a sandbox, its HEAD, which the kernel records with the
server (``/v1/kernels``: the lineage panel reads the same records). So an agent can list those
notebooks, branch or fork a notebook's HEAD (copies of its whole live state), run cells in the
copies with their output as MCP content, and check the one it picks out into the notebook: the
same ``%forkd checkout`` the panel's "Check out" runs in the notebook's kernel, between its cells.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp_types import CallToolResult, TextContent

from ..client import Controller, ControllerError, Sandbox
from ._content import CellOutput
from ._errors import Refused, explained
from ._fork_tree_tools import fork_reporting
from ._forkd_tools import CREATES, READ_ONLY, RUNS_CODE
from ._progress import run_reporting

NOTEBOOK_LABEL = "jupyter.notebook"
MAX_FORK = 64  # copies one notebook_fork makes at most: each is a live sandbox


def notebooks(ctl: Controller) -> list[dict[str, Any]]:
    """The forkd-kernel notebooks the server knows, each with its HEAD and whether HEAD still runs."""
    try:
        kernels = ctl.list_kernels()
    except ControllerError as exc:
        if exc.status == 404:  # a server without the kernels route has no forkd-kernel notebooks
            return []
        raise
    running = {sb["id"] for sb in ctl.list_sandboxes()}
    return [{"notebook": k.get("notebook"), "kernel_id": k["kernel_id"], "head": k["head"],
             "head_running": k["head"] in running, "base_snapshot": k.get("base_snapshot"),
             "engine": k.get("engine"), "updated_at": k.get("updated_at")} for k in kernels]


def find_notebook(ctl: Controller, notebook: str) -> dict[str, Any]:
    """The notebook ``notebook`` names: a kernel id, a path, or a file name only one notebook has."""
    known = notebooks(ctl)
    for key in ("kernel_id", "notebook"):
        hits = [n for n in known if n[key] == notebook]
        if hits:
            return max(hits, key=lambda n: n.get("updated_at") or 0)
    hits = [n for n in known if n["notebook"] and os.path.basename(n["notebook"]) == notebook]
    if len(hits) == 1:
        return hits[0]
    names = ", ".join(sorted({n["notebook"] or n["kernel_id"] for n in known})) or "none"
    if hits:
        raise Refused(f"{len(hits)} notebooks are called {notebook!r}",
                      f"name one by its path or kernel id (list_notebooks): {names}")
    raise Refused(f"no notebook on the forkd kernel is called {notebook!r} (known: {names})",
                  "open the notebook with the kernel 'Python 3 (forkd)', then list_notebooks names it")


def running_head(ctl: Controller, nb: dict) -> dict[str, Any]:
    """HEAD's sandbox info, or a refusal that says the notebook's sandbox is gone."""
    try:
        return ctl.get_sandbox(nb["head"])
    except ControllerError as exc:
        if exc.status != 404:
            raise
        raise Refused(f"{nb['notebook'] or nb['kernel_id']}'s sandbox {nb['head']} is gone ({exc.what})",
                      "its next cell says so in the notebook; restart its kernel, or check out a branch of it") \
            from None


def register(server: MCPServer, ctl: Controller) -> None:

    @server.tool(annotations=READ_ONLY)
    @explained("list_notebooks")
    def list_notebooks() -> list[dict[str, Any]]:
        """The notebooks running on the forkd kernel ('Python 3 (forkd)'): path, kernel_id, and
        HEAD, the sandbox holding the notebook's live state (branch or fork it to try things on
        copies; notebook_checkout moves the notebook to one)."""
        return notebooks(ctl)

    @server.tool(annotations=CREATES)
    @explained("notebook_branch")
    def notebook_branch(notebook: str, tag: str | None = None, mode: str = "live") -> dict[str, Any]:
        """Snapshot a notebook's live state (its HEAD) under ``tag``: the notebook goes on (a live
        branch pauses it a few ms), the snapshot can be forked any number of times."""
        nb = find_notebook(ctl, notebook)
        running_head(ctl, nb)
        info = ctl.branch_sandbox(nb["head"], tag, mode=mode)
        return {"notebook": nb["notebook"], "kernel_id": nb["kernel_id"], "head": nb["head"], **info}

    @server.tool(annotations=CREATES)
    @explained("notebook_fork")
    async def notebook_fork(notebook: str, n: int = 3, tag: str | None = None, lossy: bool = False,
                            ctx: Context | None = None) -> dict[str, Any]:
        """``n`` sandboxes holding copies of a notebook's current state, as one fork tree (its HEAD
        branched once, a pause of a few ms, then forked ``n`` times), labelled as the notebook's and
        with its memory limit. Try a change in each with run_cell, notebook_checkout the one you
        keep (the user's notebook moves there), then promote_sandbox it: the other copies go.
        ``tag`` names the branch (kept by promote); ``lossy`` forks even if threads or processes the
        notebook started stay behind."""
        if not 1 <= n <= MAX_FORK:
            raise Refused(f"n={n} is outside 1..{MAX_FORK}", "ask for fewer copies")
        nb = await asyncio.to_thread(find_notebook, ctl, notebook)
        head = await asyncio.to_thread(running_head, ctl, nb)
        tree = await fork_reporting(ctl, ctx, nb["head"], n, tag=tag, lossy=lossy,
                                    memory_limit_mib=head.get("memory_limit_mib"))
        return {"notebook": nb["notebook"], "kernel_id": nb["kernel_id"], "head": nb["head"],
                "fork_tree_id": tree["fork_tree_id"], "snapshot": tree["snapshot"]["tag"],
                "pause_ms": tree["snapshot"].get("pause_ms"), "sandboxes": [k["id"] for k in tree["sandboxes"]]}

    @server.tool(annotations=RUNS_CODE)
    @explained("run_cell")
    async def run_cell(sandbox_id: str, code: str, timeout_secs: float = 600,
                       ctx: Context | None = None) -> CallToolResult:
        """Run a cell in a sandbox (IPython-like: the last expression's value is shown). Its output
        comes back as it would in a notebook: printed text, rich results as text, plots and other
        pictures as images; progress notifications carry the output while it runs. A cell that
        raises is a result (``status: error`` with its traceback), not a failure of the tool. After
        ``timeout_secs`` the cell is interrupted."""
        if timeout_secs <= 0:
            raise Refused("timeout_secs must be positive", "e.g. timeout_secs=600")
        out = CellOutput()

        def work(say):
            sandbox = Sandbox(sandbox_id, ctl)

            def on_event(event: dict) -> None:
                line = out.add(event)
                if line:
                    say(line)
            return sandbox.run_code(code, timeout=timeout_secs, on_event=on_event)

        try:
            execution = await run_reporting(ctx, work)
        except asyncio.CancelledError:  # the client gave up on the call: the cell must stop too
            await asyncio.shield(asyncio.to_thread(_interrupt, ctl, sandbox_id))
            raise
        content = out.finish()
        status = "error" if execution.error else "ok"
        if not content:
            content = [TextContent(type="text", text="(the cell printed nothing and returned nothing)")]
        return CallToolResult(content=content, structured_content={
            "status": status, "sandbox_id": sandbox_id, "result": execution.text,
            "stdout": execution.stdout, "stderr": execution.stderr, "images": out.images,
            "error": None if not execution.error else {k: execution.error.get(k) for k in ("ename", "evalue")}})

    @server.tool(annotations=CREATES)
    @explained("notebook_checkout")
    def notebook_checkout(notebook: str, sandbox_id: str) -> dict[str, Any]:
        """Move a notebook to a sandbox (its next cell runs there; the lineage panel marks it HEAD):
        the user sees the copy you picked in their own notebook. Runs ``%forkd checkout`` in the
        notebook's kernel, after any cell it is running; ``%forkd checkout -`` in the notebook goes back."""
        nb = find_notebook(ctl, notebook)
        reply = ctl.checkout_kernel(nb["kernel_id"], sandbox_id, timeout=max(ctl.timeout, 120))
        return {"notebook": nb["notebook"], "kernel_id": nb["kernel_id"], "previous_head": nb["head"], **reply}

    @server.tool(annotations=READ_ONLY)
    @explained("tree")
    def tree(notebook: str | None = None) -> dict[str, Any]:
        """The lineage: every snapshot and running sandbox as nodes with their parent (a branch
        under the sandbox it came from, a sandbox under its snapshot). With ``notebook``, that
        notebook's part and its ancestors; HEADs are marked."""
        labels = None
        heads = {n["head"]: n["notebook"] or n["kernel_id"] for n in notebooks(ctl)}
        if notebook:
            nb = find_notebook(ctl, notebook)
            head_labels = running_head(ctl, nb).get("labels") or {}
            labels = {NOTEBOOK_LABEL: head_labels[NOTEBOOK_LABEL]} if NOTEBOOK_LABEL in head_labels else None
        nodes = ctl.tree(labels=labels)
        for node in nodes:
            if node.get("id") in heads:
                node["head_of"] = heads[node["id"]]
        return {"nodes": nodes}


def _interrupt(ctl: Controller, sandbox_id: str) -> None:
    try:
        ctl.interrupt(sandbox_id)
    except Exception:  # noqa: BLE001 - the sandbox may have ended meanwhile
        pass
