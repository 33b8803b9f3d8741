"""``forkd router --hosts-dns``: the hosts are every address a name resolves to, followed as they
join. The name is one of the test's own, in an /etc/hosts of the router's own (a mount namespace
made for it), resolving to loopback addresses the hosts listen on (127.0.0.2, .3, then .4)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from forkd_server.client import Controller

from ..serving import FORKD, Server
from .fleet import Router, fleet

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="a mount namespace for the router's own /etc/hosts needs root and unshare")

NAME = "forkd-hosts.fleet.test"


class AtAddress(Server):
    """``forkd serve`` on a loopback address of its own."""

    address = "127.0.0.1"

    def __init__(self, *args: str, address: str, port: int | None = None, **kwargs):
        self.address, self._port = address, port
        super().__init__(*args, **kwargs)

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    def _start(self) -> None:
        self.port = self._port or self.port
        self.proc = subprocess.Popen([*FORKD, "serve", "--host", self.address, "--port", str(self.port),
                                      "--data-dir", self.data_dir, *self.args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=self.env)


def test_hosts_found_through_a_name_and_one_that_joins():
    addresses = iter(["127.0.0.2", "127.0.0.3", "127.0.0.4"])
    port = None

    def at_next(*args, **kwargs):  # every host on the same port, as a DaemonSet's pods are
        nonlocal port
        srv = AtAddress(*args, address=next(addresses), port=port, **kwargs)
        port = srv.port
        return srv

    with fleet(2, server=at_next, router=False) as (workdir, hosts):
        hosts_file = os.path.join(workdir, "etc-hosts")
        with open(hosts_file, "w") as f:
            f.write("".join(f"{h.address} {NAME}\n" for h in hosts))
        # the router sees that file as /etc/hosts, in a mount namespace of its own
        wrap = ("unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount --bind "$0" /etc/hosts && exec "$@"', hosts_file)
        router = Router(["--hosts-dns", f"http://{NAME}:{port}"], workdir, wrap=wrap)
        try:
            router.wait(lambda h: h["hosts_up"] == 2, "find both hosts through the name")
            assert set(router.hosts()) == {h.url for h in hosts}
            Controller(hosts[1].url, hosts[1].token).create_snapshot("dns", setup="pass")
            api = Controller(router.url, router.token, timeout=120)
            assert {k["host"] for k in api.spawn_sandboxes("dns", 2)} == {hosts[1].url}
            third = at_next("--token-file", os.path.join(workdir, "token"), data_dir=os.path.join(workdir, "h2"))
            try:
                third.wait_healthy()
                with open(hosts_file, "a") as f:  # in place: the bind mount shows the same file
                    f.write(f"{third.address} {NAME}\n")
                router.wait(lambda h: h["hosts_up"] == 3, "follow the host that joined")
                assert third.url in router.hosts()
            finally:
                third.stop()
            for sb in api.list_sandboxes():
                api.kill_sandbox(sb["id"])
        finally:
            router.stop()
