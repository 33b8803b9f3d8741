"""What the router costs inside a Jupyter server (the extension's router mode) against ``forkd
router`` on a port of its own, same run.

Two ``forkd serve`` hosts (process engine), a ``forkd router`` in front of them and a ``jupyter
server`` in router mode over the same hosts (tests/fleet/fleet.py, tests/serving.py), all
subprocesses on loopback. A process snapshot ``base`` is made on host 0 and one sandbox spawned
from it, so every call below lands there whichever way it goes.

* ``ping``: ``POST .../v1/sandboxes/{id}/ping`` on a kept-alive connection (http.client) to the host
  directly, through ``forkd router`` and through the Jupyter server's ``/forkd/v1``, the three in
  each round in turn (a different one first each round) so the machine's load falls on all alike.
  Reported: each p50, and the medians of the paired differences against the host (what each router
  adds) and between the two routers (what jupyter-server's handler stack and login add).
* ``spawn(n=20)``: ``POST .../v1/sandboxes {"n": 20}`` then the 20 killed, through either router,
  alternating which goes first; each median and the median of the paired differences.

Usage: python3 bench/fleet_jupyter.py [--json] [--pings 500] [--spawns 10]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.fleet import Conn, ms
from forkd_server.client import Controller
from tests.fleet.fleet import fleet
from tests.serving import JupyterServer


def run(pings: int, spawns: int) -> dict:
    with fleet(2, router_args=("--heartbeat", "2")) as (router, hosts):
        Controller(hosts[0].url, hosts[0].token, timeout=300).create_snapshot("base", setup="x = 1")
        js = JupyterServer(args=(f"--ForkdApp.router_hosts={json.dumps([h.url for h in hosts])}",
                                 f"--ForkdApp.router_hosts_token_file={os.path.join(router.workdir, 'token')}"))
        try:
            deadline = time.monotonic() + 60
            while Controller(js.forkd_url, js.token).healthz().get("hosts_up") != 2:  # its first heartbeats
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the Jupyter server's router saw no 2 hosts up:\n{js.output()[-3000:]}")
                time.sleep(0.05)
            arms = {"direct": (Conn(hosts[0].url, hosts[0].token), ""),
                    "router": (Conn(router.url, router.token), ""),
                    "jupyter": (Conn(js.url, js.token), "/forkd")}
            sid = arms["router"][0].call("POST", "/v1/sandboxes", {"snapshot_tag": "base"})[0]["id"]
            took: dict[str, list[float]] = {name: [] for name in arms}
            names = list(arms)
            for i in range(50 + pings):  # the first 50 rounds warm every path up
                for name in names[i % 3:] + names[:i % 3]:
                    conn, prefix = arms[name]
                    t0 = time.perf_counter()
                    conn.call("POST", f"{prefix}/v1/sandboxes/{sid}/ping")
                    if i >= 50:
                        took[name].append(time.perf_counter() - t0)
            arms["router"][0].call("DELETE", f"/v1/sandboxes/{sid}")

            def spawn(name: str) -> float:
                conn, prefix = arms[name]
                t0 = time.perf_counter()
                kids = conn.call("POST", f"{prefix}/v1/sandboxes", {"snapshot_tag": "base", "n": 20})
                spent = time.perf_counter() - t0
                assert len(kids) == 20 and {k["host"] for k in kids} == {hosts[0].url}
                for k in kids:
                    arms["direct"][0].call("DELETE", f"/v1/sandboxes/{k['id']}")
                return spent

            spawn("router"), spawn("jupyter")  # warm-up
            sr, sj = [], []
            for i in range(spawns):
                for name in (("router", "jupyter") if i % 2 else ("jupyter", "router")):
                    (sr if name == "router" else sj).append(spawn(name))
        finally:
            js.stop()

    def paired(a: str, b: str) -> float:
        return ms([x - y for x, y in zip(took[a], took[b])])

    return {"ping": {"direct_p50_ms": ms(took["direct"]), "router_p50_ms": ms(took["router"]),
                     "jupyter_p50_ms": ms(took["jupyter"]), "router_adds_ms": paired("router", "direct"),
                     "jupyter_adds_ms": paired("jupyter", "direct"),
                     "jupyter_over_router_ms": paired("jupyter", "router"), "n": pings},
            "spawn20": {"router_median_ms": ms(sr), "jupyter_median_ms": ms(sj),
                        "jupyter_over_router_ms": ms([j - r for j, r in zip(sj, sr)]), "n": spawns},
            "load": os.getloadavg()[0]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--pings", type=int, default=500)
    ap.add_argument("--spawns", type=int, default=10)
    args = ap.parse_args()
    figures = run(args.pings, args.spawns)
    if args.json:
        print(json.dumps(figures))
        return 0
    p, s = figures["ping"], figures["spawn20"]
    print(f"ping p50: host {p['direct_p50_ms']} ms, forkd router {p['router_p50_ms']} ms, Jupyter server in router "
          f"mode {p['jupyter_p50_ms']} ms; added over the host (median of paired differences): forkd router "
          f"{p['router_adds_ms']} ms, Jupyter {p['jupyter_adds_ms']} ms; Jupyter over forkd router "
          f"{p['jupyter_over_router_ms']} ms (n={p['n']})")
    print(f"spawn(n=20): forkd router {s['router_median_ms']} ms, Jupyter server in router mode "
          f"{s['jupyter_median_ms']} ms, paired difference {s['jupyter_over_router_ms']} ms (n={s['n']}); "
          f"load {figures['load']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
