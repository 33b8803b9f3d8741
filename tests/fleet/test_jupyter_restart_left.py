"""A notebook is never silently fresh after its Jupyter server restarts, when that server passes
forkd on to another (remote mode: ``FORKD_URL``, a ``forkd serve``) or is a fleet's router (router
mode): stopping, it marks its forkd kernels left (``POST /v1/kernels/{id}/leave``) before it shuts
them down, so their sandboxes stay and the notebook's next kernel names where its state is. Also the
route itself, on a ``forkd serve`` and through ``forkd router``."""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request

import pytest
from jupyter_client import BlockingKernelClient

from forkd_server.client import AsyncController, Controller, ControllerError
from tests.serving import JupyterServer, serving

from ..kernel.cells import run
from .fleet import fleet
from .test_jupyter_router import router_args

NOTEBOOK = "work/left.ipynb"


def notebook_kernel(js: JupyterServer) -> tuple[str, BlockingKernelClient]:
    """A forkd kernel of NOTEBOOK, started as Lab starts one (``POST /api/sessions``): its id and a
    client of it, ready."""
    os.makedirs(os.path.join(js.workdir, os.path.dirname(NOTEBOOK)), exist_ok=True)  # the kernel's cwd
    session = js.api("POST", "/api/sessions", {"path": NOTEBOOK, "name": "left.ipynb", "type": "notebook",
                                                "kernel": {"name": "forkd-python"}})
    kernel = session["kernel"]["id"]
    kc = BlockingKernelClient(connection_file=os.path.join(js.workdir, "rt", f"kernel-{kernel}.json"))
    kc.load_connection_file()
    kc.start_channels(hb=False)  # the server watches the kernel's heartbeat
    kc.wait_for_ready(timeout=60)
    return kernel, kc


def restart_keeps_the_state(start, ctl: Controller) -> None:
    """``start()`` a Jupyter server; a notebook sets a value; the server stops (taking its kernel);
    the next server's kernel of the notebook says where the value is, and checking it out gives it."""
    js = start()
    try:
        kernel, kc = notebook_kernel(js)
        try:
            assert run(kc, "x = 'kept'").ok
            record = ctl.get_kernel(kernel)
            old = record["head"]
            assert record["notebook"] == NOTEBOOK
        finally:
            kc.stop_channels()
    finally:
        js.stop()  # SIGTERM: jupyter_server stops forkd, then its kernels
    assert ctl.get_sandbox(old)["id"] == old  # the kernel's shutdown left its HEAD running
    with pytest.raises(ControllerError) as gone:  # its record went, the notebook's HEAD kept
        ctl.get_kernel(kernel)
    assert gone.value.status == 404
    js = start()
    try:
        kernel, kc = notebook_kernel(js)
        try:
            first = run(kc, "'x' in dir()")
            fresh = ctl.get_kernel(kernel)["head"]
            assert first.result == "False"  # a fresh sandbox, as any new kernel's
            assert "stopped with the Jupyter server" in first.text and f"%forkd checkout {old}" in first.text, \
                first.text
            assert run(kc, f"%forkd checkout {old}").ok
            assert run(kc, "x").result == "'kept'"
        finally:
            kc.stop_channels()
            js.api("DELETE", f"/api/kernels/{kernel}")
        # a kernel shut down while its server runs still frees what it started and forgets itself
        deadline = time.monotonic() + 30
        while fresh in {s["id"] for s in ctl.list_sandboxes()}:  # bounded polling of the real condition
            assert time.monotonic() < deadline, f"{fresh} outlived its kernel's shutdown"
            time.sleep(0.05)
        with pytest.raises(ControllerError) as forgot:
            ctl.get_kernel(kernel)
        assert forgot.value.status == 404
    finally:
        js.stop()


def test_remote_mode_a_restarted_server_s_notebook_is_told_where_its_state_is():
    with serving() as srv:  # on exit every sandbox and snapshot of it is deleted
        ctl = Controller(srv.url, srv.token, timeout=120)
        restart_keeps_the_state(lambda: JupyterServer(env={"FORKD_URL": srv.url, "FORKD_TOKEN": srv.token}), ctl)


def test_router_mode_a_restarted_server_s_notebook_is_told_where_its_state_is():
    with fleet(1, router=False) as (workdir, hosts):  # on exit every host's objects are deleted
        ctl = Controller(hosts[0].url, hosts[0].token, timeout=120)

        def start() -> JupyterServer:
            js = JupyterServer(args=router_args(workdir, hosts))
            deadline = time.monotonic() + 60
            while True:  # bounded polling: the router's first heartbeat saw the host
                with urllib.request.urlopen(f"{js.forkd_url}/healthz", timeout=10) as r:
                    if json.loads(r.read())["hosts_up"] >= 1:
                        return js
                if time.monotonic() > deadline:
                    js.stop()
                    raise AssertionError("the router mode server saw no host up")
                time.sleep(0.05)

        restart_keeps_the_state(start, ctl)


def leave_route(ctl: Controller, sb: str, bad_id: int) -> None:
    """The route's answers: ``bad_id`` for a bad id, 404 for an unknown kernel, 204 for a recorded one,
    after which the record is gone and the notebook's next kernel's PUT answers ``left`` (once)."""
    for bad, status in (("-bad", bad_id), ("nope", 404)):
        with pytest.raises(ControllerError) as refused:
            ctl.leave_kernel(bad)
        assert refused.value.status == status and "error" in refused.value.body, refused.value.body
        with pytest.raises(ControllerError) as read:  # as the kernel's other routes answer it
            ctl.get_kernel(bad)
        assert read.value.status == status
    ctl.set_kernel_head("k-old", sb, notebook="work/route.ipynb")
    assert ctl.leave_kernel("k-old") is None
    with pytest.raises(ControllerError) as gone:
        ctl.get_kernel("k-old")
    assert gone.value.status == 404
    with pytest.raises(ControllerError) as again:  # left once: nothing left to leave
        ctl.leave_kernel("k-old")
    assert again.value.status == 404
    other = ctl.spawn_sandboxes("leave", 1)[0]["id"]
    try:
        told = ctl.set_kernel_head("k-new", other, notebook="work/route.ipynb")
        assert told["left"]["head"] == sb and told["left"]["kernel_id"] == "k-old", told
        assert "left" not in ctl.set_kernel_head("k-new", other, notebook="work/route.ipynb")  # said once
        ctl.forget_kernel("k-new")
    finally:
        ctl.kill_sandbox(other)


def test_the_leave_route_on_a_server_and_through_the_router():
    with fleet(1) as (router, hosts):
        host = Controller(hosts[0].url, hosts[0].token, timeout=120)
        host.create_snapshot("leave", setup="pass")
        sb = host.spawn_sandboxes("leave", 1)[0]["id"]
        leave_route(host, sb, 400)
        # the router finds a kernel's host by asking: an id no host takes is one none has
        leave_route(Controller(router.url, router.token, timeout=120), sb, 404)

        async def leave_async() -> None:  # the SDK's async client has it too
            async with AsyncController(hosts[0].url, hosts[0].token) as api:
                await api.set_kernel_head("k-async", sb)
                await api.leave_kernel("k-async")
                with pytest.raises(ControllerError) as gone:
                    await api.get_kernel("k-async")
                assert gone.value.status == 404
        asyncio.run(leave_async())
