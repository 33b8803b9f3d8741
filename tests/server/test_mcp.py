"""The MCP server on real sandboxes, in a real ``jupyter server`` that runs a notebook on the forkd
kernel: every tool through the mcp SDK's in-memory client (no subprocess, no port); then the same
server over streamable HTTP at ``{base_url}forkd/mcp`` with the server's token (a wrong one and none
refused), and over stdio as ``forkd mcp`` in a subprocess."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("mcp.server.mcpserver")  # mcp 2.x (forkd_server.mcp.SUPPORTED)

import httpx2  # noqa: E402 - the mcp SDK's HTTP client
from mcp import Client, StdioServerParameters  # noqa: E402
from mcp.shared.exceptions import MCPError  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

from forkd_server.client import Controller  # noqa: E402
from forkd_server.mcp import build_server  # noqa: E402

from ..serving import JupyterServer, serving  # noqa: E402

FORKD_ELEVEN = {
    "list_snapshots": [], "list_sandboxes": [], "get_sandbox": ["sandbox_id"], "kill_sandbox": ["sandbox_id"],
    "spawn_sandboxes": ["snapshot_tag", "n", "per_child_netns", "memory_limit_mib", "prewarm", "live_fork"],
    "branch_sandbox": ["sandbox_id", "tag", "diff", "measure_diff", "mode", "wait"],
    "create_snapshot": ["tag", "kernel", "rootfs", "rw", "tap", "boot_wait_secs"],
    "wait_for_text": ["sandbox_id", "path", "marker", "timeout_secs", "poll_interval_ms"],
    "exec_command": ["sandbox_id", "args", "timeout_secs"], "eval_code": ["sandbox_id", "code"],
    "ping_sandbox": ["sandbox_id"],
}
# a 1x1 PNG, written by the cell that shows it
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")


@pytest.fixture(scope="module")
def jupyter():
    srv = JupyterServer()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ctl(jupyter):
    return Controller(jupyter.forkd_url, jupyter.token)


@pytest.fixture(scope="module")
def notebook(jupyter, ctl):
    """``agent.ipynb`` open on the forkd kernel, its HEAD registered and running, ``answer = 41`` in it."""
    session = jupyter.api("POST", "/api/sessions", {"path": "agent.ipynb", "type": "notebook", "name": "agent.ipynb",
                                                    "kernel": {"name": "forkd-python"}})
    kernel_id = session["kernel"]["id"]
    deadline = time.monotonic() + 180
    while True:  # the kernel starts its sandbox in the background, then records its HEAD
        heads = [k for k in ctl.list_kernels() if k["kernel_id"] == kernel_id]
        if heads:
            break
        assert time.monotonic() < deadline, f"the forkd kernel never recorded its HEAD:\n{jupyter.output()[-3000:]}"
        time.sleep(0.1)
    assert not ctl.run_code(heads[0]["head"], "answer = 41").get("error")  # the notebook's state, as a cell leaves it
    yield {"kernel_id": kernel_id, "head": heads[0]["head"], "session": session["id"]}
    jupyter.api("DELETE", f"/api/sessions/{session['id']}")


@pytest.fixture(scope="module")
def snap(ctl):
    tag = "mcp-py"
    ctl.create_snapshot(tag, setup="x = 41")
    return tag


def run(coro):
    return asyncio.run(coro)


async def call(ctl, name: str, args: dict | None = None, **kw):
    async with Client(build_server(ctl)) as client:
        return await client.call_tool(name, args or {}, **kw)


def data(result):
    """A tool's structured result (the value the tool returned)."""
    assert not result.is_error, result.content[0].text
    value = result.structured_content
    return value["result"] if isinstance(value, dict) and set(value) == {"result"} else value


def failure(result) -> str:
    assert result.is_error, result
    text = result.content[0].text
    assert "Traceback" not in text and 'File "' not in text  # what failed and what to do, never our traceback
    return text


# --- in memory: every tool -----------------------------------------------------------------------

def test_tools_keep_forkd_mcp_names_parameters_and_say_what_destroys(ctl):
    async def listing():
        async with Client(build_server(ctl)) as client:
            return (await client.list_tools()).tools
    tools = {t.name: t for t in run(listing())}
    for name, params in FORKD_ELEVEN.items():
        assert list(tools[name].input_schema.get("properties", {}))[:len(params)] == params, name
    assert tools["spawn_sandboxes"].input_schema["properties"]["memory_limit_mib"]["default"] == 256  # forkd's
    assert {"list_notebooks", "notebook_branch", "notebook_fork", "run_cell", "notebook_checkout", "tree",
            "delete_snapshot"} <= set(tools)
    destructive = {n for n, t in tools.items() if t.annotations.destructive_hint}
    assert destructive == {"kill_sandbox", "delete_snapshot", "promote_sandbox"}
    assert all(tools[n].annotations.read_only_hint for n in ("list_snapshots", "list_sandboxes", "get_sandbox",
                                                             "ping_sandbox", "list_notebooks", "tree"))


def test_sandbox_tools_on_real_sandboxes(ctl, snap):
    progress = []

    async def on_progress(done, total, message):
        progress.append((done, total, message))

    async def scenario():
        async with Client(build_server(ctl)) as c:
            kids = data(await c.call_tool("spawn_sandboxes", {"snapshot_tag": snap, "n": 2},
                                          progress_callback=on_progress))
            ids = [k["id"] for k in kids]
            listed = {s["id"] for s in data(await c.call_tool("list_sandboxes"))}
            got = data(await c.call_tool("get_sandbox", {"sandbox_id": ids[0]}))
            pong = data(await c.call_tool("ping_sandbox", {"sandbox_id": ids[0]}))
            value = data(await c.call_tool("eval_code", {"sandbox_id": ids[0], "code": "x + 1"}))
            ran = data(await c.call_tool("exec_command", {"sandbox_id": ids[0], "args": [
                "sh", "-c", "echo step-1 > /tmp/job.log; echo started; echo oops >&2; exit 3"]}))
            waited = data(await c.call_tool("wait_for_text", {"sandbox_id": ids[0], "path": "/tmp/job.log",
                                                              "marker": "step-1"}))
            late = failure(await c.call_tool("wait_for_text", {"sandbox_id": ids[0], "path": "/tmp/job.log",
                                                               "marker": "step-2", "timeout_secs": 0.5,
                                                               "poll_interval_ms": 100}))
            statement = data(await c.call_tool("eval_code", {"sandbox_id": ids[0], "code": "x = 99"}))
            await c.call_tool("run_cell", {"sandbox_id": ids[0], "code": "x = 99"})
            branch = data(await c.call_tool("branch_sandbox", {"sandbox_id": ids[0], "mode": "live"}))
            tags = {s["tag"] for s in data(await c.call_tool("list_snapshots"))}
            grand = data(await c.call_tool("spawn_sandboxes", {"snapshot_tag": branch["tag"]}))[0]["id"]
            carried = data(await c.call_tool("eval_code", {"sandbox_id": grand, "code": "x"}))
            killed = [data(await c.call_tool("kill_sandbox", {"sandbox_id": i})) for i in (*ids, grand)]
            gone = failure(await c.call_tool("get_sandbox", {"sandbox_id": ids[0]}))
            deleted = data(await c.call_tool("delete_snapshot", {"tag": branch["tag"]}))
            return locals()

    r = run(scenario())
    assert set(r["ids"]) <= r["listed"] and r["got"]["snapshot_tag"] == snap
    assert r["pong"] and r["value"]["result"] == "42"
    assert (r["ran"]["stdout"], r["ran"]["stderr"], r["ran"]["exit_code"]) == ("started\n", "oops\n", 3)
    assert r["waited"]["found"] and "step-1" in r["waited"]["tail"]
    assert "'step-2' did not appear in /tmp/job.log" in r["late"] and "\n" in r["late"]  # what, then what to do
    assert "SyntaxError" in r["statement"]["error"]  # forkd's eval takes one expression: run_cell runs statements
    assert r["branch"]["tag"] in r["tags"] and r["carried"]["result"] == "99"
    assert r["killed"][0] == {"id": r["ids"][0], "killed": True}
    assert r["gone"].startswith("Error executing tool get_sandbox: sandbox ") and r["ids"][0] in r["gone"]
    assert r["deleted"] == {"tag": r["branch"]["tag"], "deleted": True}
    started = [m for _, _, m in progress if "started" in (m or "")]
    assert len(started) == 2 and all(total == 2 for _, total, _ in progress)  # one per child as it started


def test_create_snapshot_both_forms(ctl):
    async def scenario():
        async with Client(build_server(ctl)) as c:
            made = data(await c.call_tool("create_snapshot", {"tag": "mcp-made", "setup": "y = 2"}))
            half = failure(await c.call_tool("create_snapshot", {"tag": "mcp-vm", "kernel": "/no/vmlinux"}))
            missing = failure(await c.call_tool("create_snapshot", {"tag": "mcp-vm", "kernel": "/no/vmlinux",
                                                                    "rootfs": "/no/rootfs"}))
            await c.call_tool("delete_snapshot", {"tag": "mcp-made"})
            return made, half, missing
    made, half, missing = run(scenario())
    assert made["tag"] == "mcp-made" and made["status"] == "ready"
    assert "kernel and rootfs go together" in half
    assert "kernel not found: /no/vmlinux" in missing  # the server's 400, said as it says it


def test_run_cell_gives_output_in_order_images_as_images_and_errors_as_results(ctl, snap):
    code = ("import base64\nprint('before')\n"
            "class Pic:\n    def _repr_png_(self):\n"
            f"        return base64.b64decode({base64.b64encode(PNG).decode()!r})\n"
            "display(Pic())\nprint('after')\nx * 2")
    progress = []

    async def on_progress(done, total, message):
        progress.append(message)

    async def scenario():
        async with Client(build_server(ctl)) as c:
            sid = data(await c.call_tool("spawn_sandboxes", {"snapshot_tag": snap}))[0]["id"]
            ok = await c.call_tool("run_cell", {"sandbox_id": sid, "code": code}, progress_callback=on_progress)
            bad = await c.call_tool("run_cell", {"sandbox_id": sid, "code": "print('half')\n1 / 0"})
            await c.call_tool("kill_sandbox", {"sandbox_id": sid})
            return ok, bad
    ok, bad = run(scenario())
    kinds = [(b.type, getattr(b, "text", None)) for b in ok.content]
    assert kinds[0] == ("text", "before\n") and kinds[1][0] == "image" and kinds[2] == ("text", "after\n")
    assert kinds[3] == ("text", "82")
    assert base64.b64decode(ok.content[1].data) == PNG and ok.content[1].mime_type == "image/png"
    assert ok.structured_content["status"] == "ok" and ok.structured_content["result"] == "82"
    assert any("before" in (m or "") for m in progress)  # output reached the client while the cell ran
    assert not bad.is_error and bad.structured_content["status"] == "error"  # the cell's failure is its result
    assert bad.structured_content["error"]["ename"] == "ZeroDivisionError"
    assert bad.content[0].text == "half\n" and bad.content[1].text.startswith("ZeroDivisionError: division by zero")


def test_resources_tree_and_a_sandboxes_files(ctl, snap):
    async def scenario():
        async with Client(build_server(ctl)) as c:
            sid = data(await c.call_tool("spawn_sandboxes", {"snapshot_tag": snap}))[0]["id"]
            await c.call_tool("exec_command", {"sandbox_id": sid,
                                               "args": ["sh", "-c", "printf 'a,b\\n1,2\\n' > /tmp/t.csv"]})
            tree = await c.read_resource("forkd://tree")
            text = await c.read_resource(f"forkd://sandboxes/{sid}/files/tmp/t.csv")
            listing = await c.read_resource(f"forkd://sandboxes/{sid}/files/tmp")
            await c.call_tool("exec_command", {"sandbox_id": sid, "args": ["sh", "-c", "printf '\\377\\000' > /tmp/b"]})
            binary = await c.read_resource(f"forkd://sandboxes/{sid}/files/tmp/b")
            try:
                await c.read_resource(f"forkd://sandboxes/{sid}/files/tmp/none.csv")
                missing = None
            except MCPError as exc:
                missing = exc
            templates = (await c.list_resource_templates()).resource_templates
            await c.call_tool("kill_sandbox", {"sandbox_id": sid})
            return sid, tree, text, listing, templates, binary, missing
    sid, tree, text, listing, templates, binary, missing = run(scenario())
    assert base64.b64decode(binary.contents[0].blob) == b"\xff\x00"
    assert missing is not None and "none.csv" in str(missing) and "Traceback" not in str(missing)
    nodes = json.loads(tree.contents[0].text)
    assert any(n["id"] == sid for n in nodes) and any(n["id"] == snap for n in nodes)
    assert text.contents[0].text == "a,b\n1,2\n"
    assert "t.csv" in {e["name"] for e in json.loads(listing.contents[0].text)}
    assert templates[0].uri_template == "forkd://sandboxes/{sandbox_id}/files/{+path}"


def test_notebook_tools_fork_a_live_notebook_and_check_the_pick_out(ctl, notebook):
    kid = notebook["kernel_id"]
    progress = []

    async def on_progress(done, total, message):
        progress.append((done, total, message))

    async def scenario():
        async with Client(build_server(ctl)) as c:
            listed = data(await c.call_tool("list_notebooks"))
            branch = data(await c.call_tool("notebook_branch", {"notebook": "agent.ipynb"}))
            forked = data(await c.call_tool("notebook_fork", {"notebook": kid, "n": 3}, progress_callback=on_progress))
            cells = [await c.call_tool("run_cell", {"sandbox_id": sb, "code": f"answer += {i}\nanswer"})
                     for i, sb in enumerate(forked["sandboxes"])]
            pick = next(sb for sb, cell in zip(forked["sandboxes"], cells) if cell.structured_content["result"] == "42")
            moved = data(await c.call_tool("notebook_checkout", {"notebook": "agent.ipynb", "sandbox_id": pick}))
            recorded = ctl.get_kernel(kid)["head"]  # what the kernel itself recorded when it moved
            tree = data(await c.call_tool("tree", {"notebook": "agent.ipynb"}))
            unknown = failure(await c.call_tool("notebook_fork", {"notebook": "nope.ipynb"}))
            gone = failure(await c.call_tool("notebook_checkout", {"notebook": kid, "sandbox_id": "sb-nope"}))
            kept = data(await c.call_tool("promote_sandbox", {"sandbox_id": pick}))  # the pick is HEAD by now
            back = data(await c.call_tool("notebook_checkout", {"notebook": kid, "sandbox_id": notebook["head"]}))
            await c.call_tool("kill_sandbox", {"sandbox_id": pick})
            return locals()

    r = run(scenario())
    mine = next(n for n in r["listed"] if n["kernel_id"] == kid)
    assert mine["notebook"] == "agent.ipynb" and mine["head"] == notebook["head"] and mine["head_running"]
    assert r["branch"]["head"] == notebook["head"] and r["branch"]["labels"]["jupyter.notebook"] == "agent.ipynb"
    assert len(r["forked"]["sandboxes"]) == 3 and r["forked"]["pause_ms"] is not None
    assert r["forked"]["fork_tree_id"].startswith("ft-") and r["forked"]["snapshot"] == r["forked"]["fork_tree_id"]
    assert progress[0][2] == f"branching {notebook['head']}"
    assert progress[1][2].startswith(f"branched as {r['forked']['snapshot']}")
    assert sum("started" in m for _, _, m in progress) == 3  # then one per copy as it started
    assert [p for p, _, _ in progress] == [0, 1, 2, 3, 4] and {t for _, t, _ in progress} == {4}  # only ever grows
    assert [c.structured_content["result"] for c in r["cells"]] == ["41", "42", "43"]  # each copy holds answer = 41
    assert r["moved"]["head"] == r["pick"] == r["recorded"] and r["moved"]["previous_head"] == notebook["head"]
    nodes = {n["id"]: n for n in r["tree"]["nodes"]}
    assert nodes[r["pick"]]["head_of"] == "agent.ipynb"
    assert "no notebook on the forkd kernel is called 'nope.ipynb'" in r["unknown"]
    assert "sb-nope" in r["gone"] and r["back"]["head"] == notebook["head"] == ctl.get_kernel(kid)["head"]
    # one fork tree: keeping the pick killed the other copies and released the branch nothing else needs
    assert r["kept"]["fork_tree_id"] == r["forked"]["fork_tree_id"] and r["kept"]["winner"]["id"] == r["pick"]
    assert sorted(r["kept"]["killed"]) == sorted(set(r["forked"]["sandboxes"]) - {r["pick"]})
    assert r["kept"]["released"] == [r["forked"]["snapshot"]] and not r["kept"]["failed"]
    assert {sb["id"] for sb in ctl.list_sandboxes()} & set(r["forked"]["sandboxes"]) == set()


def test_errors_say_what_failed_and_what_to_do():
    dead = Controller("http://127.0.0.1:9", "t")  # nothing listens on the discard port
    text = failure(run(call(dead, "list_sandboxes")))
    assert text.startswith("Error executing tool list_sandboxes: no forkd server answers at http://127.0.0.1:9")
    assert "FORKD_URL" in text


def test_a_taken_tag_says_which_tool_frees_it():
    from forkd_server.client import ControllerError
    from forkd_server.mcp._errors import describe
    taken = ControllerError(400, {"error": "snapshot py already exists; DELETE first"}, "http://h/v1/snapshots")
    assert describe(taken) == ("snapshot py already exists\nchoose another tag, or delete that one first with "
                               "delete_snapshot")  # not REST's 'DELETE first', nor 'fix the arguments'


# --- streamable HTTP in the jupyter server, with its token ---------------------------------------

def _http(url: str, token: str | None, scheme: str = "token"):
    headers = {"Authorization": f"{scheme} {token}"} if token else {}
    return streamable_http_client(url, http_client=httpx2.AsyncClient(headers=headers, timeout=60))


def test_streamable_http_in_jupyter_server_with_its_token(jupyter, snap):
    async def scenario():
        async with Client(_http(jupyter.mcp_url, jupyter.token)) as c:
            names = {t.name for t in (await c.list_tools()).tools}
            sid = data(await c.call_tool("spawn_sandboxes", {"snapshot_tag": snap}))[0]["id"]
            progress = []

            async def on_progress(done, total, message):
                progress.append(message)
            cell = await c.call_tool("run_cell", {"sandbox_id": sid, "code": "print('streamed')\nx"},
                                     progress_callback=on_progress)
            value = data(await c.call_tool("eval_code", {"sandbox_id": sid, "code": "x"}))
            await c.call_tool("kill_sandbox", {"sandbox_id": sid})
            return names, cell, value, progress
    names, cell, value, progress = run(scenario())
    assert "notebook_fork" in names and value["result"] == "41"
    assert cell.structured_content["stdout"] == "streamed\n" and "streamed" in progress


def _eval_requests(jupyter, handler: str = "EvalHandler") -> float:
    """How many ``POST .../eval`` (``handler``'s) requests the Jupyter server has answered (its own
    metrics)."""
    req = urllib.request.Request(jupyter.forkd_url.rsplit("/forkd", 1)[0] + "/metrics",
                                 headers={"Authorization": f"token {jupyter.token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("http_request_duration_seconds_count") and f".{handler}" in line)


COMMAND = ["sh", "-c", "echo $((6*7)); exit 2"]


def test_in_the_server_eval_exec_and_ping_are_its_own_calls_answered_as_their_routes(jupyter, ctl, snap):
    """Inside the Jupyter server, eval_code, exec_command and ping_sandbox make no second request back
    into it; what they answer, and how they fail, is what the SDK's way (the route) gives."""
    sid = ctl.spawn_sandboxes(snap, 1)[0]["id"]
    gone = ctl.spawn_sandboxes(snap, 1)[0]["id"]
    ctl.kill_sandbox(gone)

    async def scenario():
        async with Client(_http(jupyter.mcp_url, jupyter.token)) as c:
            before = _eval_requests(jupyter)
            value = data(await c.call_tool("eval_code", {"sandbox_id": sid, "code": "x * 2"}))
            error = data(await c.call_tool("eval_code", {"sandbox_id": sid, "code": "1/0"}))
            pong = data(await c.call_tool("ping_sandbox", {"sandbox_id": sid}))
            evals = _eval_requests(jupyter) - before
            before_exec = _eval_requests(jupyter, "ExecHandler")
            ran = data(await c.call_tool("exec_command", {"sandbox_id": sid, "args": COMMAND}))
            execs = _eval_requests(jupyter, "ExecHandler") - before_exec
            missing = failure(await c.call_tool("eval_code", {"sandbox_id": gone, "code": "x"}))
            unknown = failure(await c.call_tool("ping_sandbox", {"sandbox_id": "sb-nope"}))
            return value, error, pong, evals, missing, unknown, ran, execs
    value, error, pong, evals, missing, unknown, ran, execs = run(scenario())
    by_sdk = [failure(run(call(ctl, "eval_code", {"sandbox_id": gone, "code": "x"}))),
              failure(run(call(ctl, "ping_sandbox", {"sandbox_id": "sb-nope"})))]
    before = _eval_requests(jupyter)
    same = ctl.eval_code(sid, "x * 2"), ctl.eval_code(sid, "1/0"), ctl.ping_sandbox(sid)
    assert ran == ctl.exec_command(sid, COMMAND) and ran["stdout"] == "42\n" and ran["exit_code"] == 2
    assert execs == 0, "an exec through MCP went back into the server over HTTP"
    assert _eval_requests(jupyter) - before == 2  # the count counts: the SDK's evals are requests
    ctl.kill_sandbox(sid)
    assert evals == 0, "an eval through MCP went back into the server over HTTP"
    assert value == same[0] and value["result"] == "82"  # the route's answer, field for field
    assert error == same[1] and "ZeroDivisionError" in error["error"]
    assert set(pong) == set(same[2]) and pong
    assert [missing, unknown] == by_sdk  # word for word what the route's 404s say through the SDK
    assert gone in missing and "sb-nope" in unknown


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789"])
def test_streamable_http_refuses_without_the_right_token(jupyter, token):
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    if token:
        headers["Authorization"] = f"token {token}"
    req = urllib.request.Request(jupyter.mcp_url, data=body, headers=headers, method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=30)
    assert refused.value.code == 401
    assert json.loads(refused.value.read())["error"] == ("invalid bearer token" if token else "missing bearer token")


def test_streamable_http_in_forkd_serve():
    """``forkd serve`` carries the same server at /mcp, behind its bearer token."""
    with serving() as srv:
        Controller(srv.url, srv.token).create_snapshot("mcp-serve", setup="z = 7")

        async def scenario():
            async with Client(_http(f"{srv.url}/mcp", srv.token, "Bearer")) as c:
                sid = data(await c.call_tool("spawn_sandboxes", {"snapshot_tag": "mcp-serve"}))[0]["id"]
                value = data(await c.call_tool("eval_code", {"sandbox_id": sid, "code": "z * 6"}))
                notebooks = data(await c.call_tool("list_notebooks"))
                await c.call_tool("kill_sandbox", {"sandbox_id": sid})
                return value, notebooks
        value, notebooks = run(scenario())
        # a kernel that records its HEAD here but runs in another Jupyter server cannot be checked out here
        ctl = Controller(srv.url, srv.token)
        sid = ctl.spawn_sandboxes("mcp-serve", 1)[0]["id"]
        ctl.set_kernel_head("elsewhere-1", sid, notebook="far.ipynb")
        elsewhere = failure(run(call(ctl, "notebook_checkout", {"notebook": "far.ipynb", "sandbox_id": sid})))
        bad_id = failure(run(call(ctl, "notebook_checkout", {"notebook": "far.ipynb", "sandbox_id": "a b"})))
        ctl.forget_kernel("elsewhere-1")
        ctl.kill_sandbox(sid)
        refused = urllib.request.Request(f"{srv.url}/mcp", data=b"{}", method="POST",
                                         headers={"Authorization": "Bearer not-the-token-0123456789"})
        with pytest.raises(urllib.error.HTTPError) as no:
            urllib.request.urlopen(refused, timeout=30)
    assert value["result"] == "42" and notebooks == []  # no notebooks run in forkd serve
    assert "the kernel of far.ipynb does not run in this Jupyter server" in elsewhere
    assert "run `%forkd checkout " in elsewhere  # what to do instead
    assert "'a b' is not a sandbox id" in bad_id
    assert no.value.code == 401


# --- stdio: `forkd mcp` in a subprocess -----------------------------------------------------------

def test_stdio_forkd_mcp_subprocess(jupyter, snap):
    env = {**os.environ, "FORKD_URL": jupyter.forkd_url, "FORKD_TOKEN": jupyter.token}
    params = StdioServerParameters(command=sys.executable, args=["-m", "forkd_server.cli", "mcp"], env=env)

    async def scenario():
        async with Client(params) as c:
            sid = data(await c.call_tool("spawn_sandboxes", {"snapshot_tag": snap}))[0]["id"]
            value = data(await c.call_tool("eval_code", {"sandbox_id": sid, "code": "x + 1"}))
            await c.call_tool("kill_sandbox", {"sandbox_id": sid})
            return value
    assert run(scenario())["result"] == "42"


def test_run_cell_cancelled_by_the_client_interrupts_the_cell(ctl, snap):
    import anyio

    async def scenario():
        async with Client(build_server(ctl)) as c:
            sid = data(await c.call_tool("spawn_sandboxes", {"snapshot_tag": snap}))[0]["id"]
            started = anyio.Event()

            async def on_progress(done, total, message):
                started.set()

            async def long_cell():
                await c.call_tool("run_cell", {"sandbox_id": sid, "code": (
                    "import time\nprint('running', flush=True)\n"
                    "for _ in range(600):\n    time.sleep(0.1)\nfinished = True")},
                    progress_callback=on_progress)

            async with anyio.create_task_group() as tg:
                tg.start_soon(long_cell)
                await started.wait()  # the cell is running: it printed
                tg.cancel_scope.cancel()
            t0 = time.monotonic()
            after = data(await c.call_tool("eval_code", {"sandbox_id": sid, "code": "'finished' in globals()"}))
            waited = time.monotonic() - t0
            await c.call_tool("kill_sandbox", {"sandbox_id": sid})
            return after, waited
    after, waited = run(scenario())
    assert after["result"] == "False" and waited < 30  # interrupted, not left to run its 60 s


# --- off: c.ForkdApp.mcp = False -------------------------------------------------------------------

@pytest.fixture
def jp_server_config(forkd_data_dir):
    return {"ServerApp": {"jpserver_extensions": {"forkd_server": True, "jupyter_server_terminals": False}},
            "ForkdApp": {"data_dir": forkd_data_dir, "mcp": False}}


async def test_mcp_turned_off_answers_503_saying_so(jp_fetch, forkd_app):
    r = await jp_fetch("forkd", "mcp", method="POST", body="{}", raise_error=False,
                       headers={"Content-Type": "application/json"})
    assert r.code == 503
    assert json.loads(r.body)["error"] == "no MCP server here: it is off (c.ForkdApp.mcp = False)"
