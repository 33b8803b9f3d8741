"""A ``forkd serve`` host in a network namespace of its own, joined to the root namespace by a veth
pair on a /30 of 10.0.0.0/8 (iproute2, as root): traffic between the router and the host crosses a
real link that a test can cut (``partition``) and mend (``heal``). A service the hosts share (the
store) listens on a root-namespace address of its own (``service_address``), which each host
reaches through its link."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import subprocess

from tests.serving import FORKD, Server

PORT = 8889


def available() -> str | None:
    """Why namespaced hosts cannot run here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        return "iproute2's ip and util-linux's nsenter are needed"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /30 no interface of this machine is on (parallel runs draw their own at random)."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    while True:
        net = ipaddress.ip_network(f"10.{secrets.randbelow(200) + 40}.{secrets.randbelow(256)}.{4 * secrets.randbelow(64)}/30")
        if str(net.network_address)[:-2] not in used:
            return net


@contextlib.contextmanager
def service_address():
    """Yields an address of the root namespace for a service that namespaced hosts use: on a bridge
    of its own with no ports (a dummy link needs a module some kernels lack); a host given it in ``reach`` routes
    to it through its veth link. The bridge, and so the address, goes on exit."""
    link = f"fks{secrets.token_hex(3)}"
    addr = str(_free_subnet().network_address + 1)
    _ip("link", "add", link, "type", "bridge")
    try:
        _ip("addr", "add", f"{addr}/32", "dev", link)
        _ip("link", "set", link, "up")
        yield addr
    finally:
        subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)


class NamespacedServer(Server):
    """``forkd serve`` inside namespace ``ns`` at ``10.a.b.c+2:8889``; the root side is ``c+1``.
    ``reach``: root-namespace addresses (``service_address``) the host routes to over its link."""

    def __init__(self, *args: str, data_dir: str, env: dict | None = None, reach: tuple[str, ...] = ()):
        tag = secrets.token_hex(3)
        self.ns, self.veth, self.peer = f"fk{tag}", f"fkr{tag}", f"fkn{tag}"
        net = _free_subnet()
        self.root_addr, self.addr = str(net.network_address + 1), str(net.network_address + 2)
        _ip("netns", "add", self.ns)
        try:
            _ip("link", "add", self.veth, "type", "veth", "peer", "name", self.peer)
            _ip("link", "set", self.peer, "netns", self.ns)
            _ip("addr", "add", f"{self.root_addr}/30", "dev", self.veth)
            _ip("link", "set", self.veth, "up")
            _ip("-n", self.ns, "addr", "add", f"{self.addr}/30", "dev", self.peer)
            _ip("-n", self.ns, "link", "set", self.peer, "up")
            _ip("-n", self.ns, "link", "set", "lo", "up")
            for addr in reach:
                _ip("-n", self.ns, "route", "add", f"{addr}/32", "via", self.root_addr)
            super().__init__(*args, data_dir=data_dir, env=env)
        except BaseException:
            self.remove()
            raise

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}"

    def _start(self) -> None:
        self.port = PORT
        # nsenter joins the network namespace only (ip netns exec also remounts /sys, which hides
        # the cgroup file system the host limits its sandboxes with)
        self.proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{self.ns}", "--", *FORKD, "serve",
                                      "--host", self.addr, "--port", str(self.port), "--data-dir", self.data_dir,
                                      *self.args], stdout=self.log, stderr=subprocess.STDOUT, env=self.env)

    def partition(self) -> None:
        """Cut the link: the host runs on, unreachable."""
        _ip("link", "set", self.veth, "down")

    def heal(self) -> None:
        _ip("link", "set", self.veth, "up")

    def remove(self) -> None:
        """Delete the namespace (its end of the veth pair goes with it, and so the other end)."""
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.veth], capture_output=True, check=False)  # gone with it, normally
