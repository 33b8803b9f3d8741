"""(Not bench/mcp.py: that name would hide the mcp package from this script.)

What the MCP server costs an agent: ``eval_code`` through MCP versus the same call through the SDK.

Target: an MCP ``eval_code`` round trip over streamable HTTP, p50 <= 10 ms.

Method. A real ``jupyter server`` with forkd (its token, a data dir of its own) and one sandbox of a
small snapshot. An MCP client session is opened once, as an agent keeps one, against
``{base_url}forkd/mcp`` (streamable HTTP: each call is a POST whose answer comes as an SSE stream);
a second session talks to the same MCP server in memory (the MCP layer alone, no HTTP); and the SDK
calls ``POST /v1/sandboxes/{id}/eval`` directly (what every MCP call does underneath). Each round
times every way once, in turn, so a busy machine's load falls on all alike; the figures are the
p50s and the medians of the paired differences with the SDK call.

Usage: python3 bench/mcp_server.py [--json] [--iterations 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx2  # noqa: E402 - the mcp SDK's HTTP client
from mcp import Client  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

from forkd_server.client import Controller  # noqa: E402
from forkd_server.mcp import build_server  # noqa: E402
from tests.serving import JupyterServer  # noqa: E402

TARGET_P50_MS = 10.0


def stats(ms: list[float]) -> dict:
    ms = sorted(ms)
    return {"p50_ms": round(statistics.median(ms), 3), "p90_ms": round(ms[int(len(ms) * 0.9) - 1], 3),
            "mean_ms": round(statistics.fmean(ms), 3), "n": len(ms)}


async def measure(server: JupyterServer, sandbox: str, n: int, warmup: int) -> dict:
    ctl = Controller(server.forkd_url, server.token)
    http = httpx2.AsyncClient(headers={"Authorization": f"token {server.token}"}, timeout=60)
    args = {"sandbox_id": sandbox, "code": "x + 1"}
    async with Client(streamable_http_client(server.mcp_url, http_client=http)) as over_http, \
            Client(build_server(ctl)) as in_memory:

        async def mcp_http():
            result = await over_http.call_tool("eval_code", args)
            assert result.structured_content["result"] == "42", result

        async def mcp_memory():
            result = await in_memory.call_tool("eval_code", args)
            assert result.structured_content["result"] == "42", result

        async def sdk():
            assert ctl.eval_code(sandbox, "x + 1")["result"] == "42"

        ways = {"mcp_streamable_http": mcp_http, "mcp_in_memory": mcp_memory, "sdk_rest": sdk}
        samples: dict[str, list[float]] = {name: [] for name in ways}
        for i in range(warmup + n):
            for name, way in ways.items():
                t0 = time.perf_counter()
                await way()
                if i >= warmup:
                    samples[name].append((time.perf_counter() - t0) * 1000)
    out = {name: stats(ms) for name, ms in samples.items()}
    for name in ("mcp_streamable_http", "mcp_in_memory"):
        out[name]["over_sdk_p50_ms"] = round(statistics.median(
            a - b for a, b in zip(samples[name], samples["sdk_rest"])), 3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    args = parser.parse_args()
    server = JupyterServer()
    try:
        ctl = Controller(server.forkd_url, server.token)
        ctl.create_snapshot("bench-mcp", setup="x = 41")
        sandbox = ctl.spawn_sandboxes("bench-mcp", 1)[0]["id"]
        figures = asyncio.run(measure(server, sandbox, args.iterations, args.warmup))
    finally:
        server.stop()
    p50 = figures["mcp_streamable_http"]["p50_ms"]
    out = {"eval_code": figures, "load_average": round(os.getloadavg()[0], 2),
           "target": {"mcp_eval_code_streamable_http_p50_ms": TARGET_P50_MS, "measured_p50_ms": p50,
                      "met": p50 <= TARGET_P50_MS}}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for name, f in figures.items():
            extra = f" ({f['over_sdk_p50_ms']:+.3f} ms over the SDK, paired)" if "over_sdk_p50_ms" in f else ""
            print(f"{name:22} p50 {f['p50_ms']:.3f} ms  p90 {f['p90_ms']:.3f} ms{extra}")
        print(f"target: MCP eval_code over streamable HTTP p50 <= {TARGET_P50_MS} ms: "
              f"{'met' if out['target']['met'] else 'NOT met'} ({p50:.3f} ms; load average {out['load_average']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
