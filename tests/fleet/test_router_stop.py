"""The router stops when asked even if a loop of its own took its cancel for something else.

A cancel that lands as a request's own timeout fires is taken by aiohttp for that timeout (the
request raises TimeoutError, which a beat handles as a host that did not answer): a loop that ended
only on its cancel then beat on, and held ``forkd router``'s exit forever after SIGTERM (seen once
in a CI run: the port closed, the heartbeat still beating 40 minutes later). Here a beat that
swallows its cancel stands in for that race."""

from __future__ import annotations

import asyncio

from forkd_server.fleet.hosts import Heartbeat


def test_the_heartbeat_stops_though_a_beat_swallows_its_cancel():
    async def run() -> int:
        beat_began = asyncio.Event()
        beats = 0

        async def swallowing_beat(host) -> None:
            nonlocal beats
            beats += 1
            beat_began.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass  # taken for the request's own timeout: the beat returns as after a HostError

        heartbeat = Heartbeat(interval=0.01, down_after=5, timeout=5, on_up=None, on_down=None)
        heartbeat.beat = swallowing_beat
        heartbeat.watch(object())
        await beat_began.wait()
        await asyncio.wait_for(heartbeat.stop(), 5)  # TimeoutError here: the router never exits
        return beats

    assert asyncio.run(run()) == 1  # and it did not beat again after the stop
