"""A VM snapshot moves to where there is room: two ``forkd serve`` hosts on the VM engine sharing a
store (moto's S3 on loopback), host 0 capped at one sandbox. A spawn of 3 from a snapshot host 0
made and never pushed places one child there and two on host 1, which pulled the snapshot after
host 0 pushed it on demand; a live branch on host 1 stays on host 1."""

from __future__ import annotations

import os

import pytest

from forkd_server.client import Controller

from ..store.s3 import S3_ENV, moto_s3
from ..vm.conftest import requires_qemu
from .fleet import fleet

pytestmark = [requires_qemu, pytest.mark.slow]


def test_a_vm_snapshot_spills_over_by_push_and_pull():
    with moto_s3() as (endpoint, log):
        env = {**S3_ENV, "AWS_ENDPOINT_URL": endpoint}
        os.environ.update(env)  # the hosts inherit it (fleet() passes os.environ)
        try:
            store = ["--store", "s3://forkd/fleet"]
            with fleet(2, host_args=[[*store, "--ForkdApp.max_sandboxes=1"], store]) as (router, hosts):
                api = Controller(router.url, router.token, timeout=600)
                h0, h1 = (Controller(h.url, h.token, timeout=600) for h in hosts)
                h0.create_snapshot("vmbase", engine="vm", mem_size_mib=256, setup="x = 41")
                assert "vmbase" not in {s["tag"] for s in h1.list_snapshots()}
                kids = api.spawn_sandboxes("vmbase", 3)
                where = [k["host"] for k in kids]
                assert where.count(hosts[0].url) == 1 and where.count(hosts[1].url) == 2
                assert h1.snapshot_info("vmbase")["stored"]["remote"] is True  # pulled from the store
                assert any(m == "PUT" for m, _ in log)  # host 0 pushed it on demand
                on1 = [k["id"] for k in kids if k["host"] == hosts[1].url]
                assert [api.eval_code(k["id"], "x + 1")["result"] for k in kids] == ["42"] * 3
                api.run_code(on1[0], "x = 99")
                snap = api.branch_sandbox(on1[0], "vmbase-99", mode="live")
                assert snap["host"] == hosts[1].url
                api.wait_snapshot("vmbase-99", timeout=600)
                grandkid = api.spawn_sandboxes("vmbase-99")[0]
                assert grandkid["host"] == hosts[1].url
                assert api.eval_code(grandkid["id"], "x")["result"] == "99"
                for k in kids + [grandkid]:
                    api.kill_sandbox(k["id"])
        finally:
            for name in env:
                os.environ.pop(name, None)
