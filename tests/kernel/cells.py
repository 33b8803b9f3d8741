"""Cells run through a real kernel's client, and what they showed."""

from __future__ import annotations

import threading
from typing import Callable


class Cell:
    def __init__(self, reply: dict, messages: list[dict]):
        self.reply, self.messages = reply, messages
        self.content = reply["content"]

    @property
    def ok(self) -> bool:
        return self.content["status"] == "ok"

    @property
    def count(self) -> int:
        return self.content["execution_count"]

    def of(self, kind: str) -> list[dict]:
        return [m["content"] for m in self.messages if m["msg_type"] == kind]

    @property
    def text(self) -> str:
        """What the cell showed as text: its streams, then its results."""
        parts = [c["text"] for c in self.of("stream")]
        parts += [c["data"].get("text/plain", "") for c in self.of("execute_result") + self.of("display_data")]
        parts += [f"{c['ename']}: {c['evalue']}" for c in self.of("error")]
        return "\n".join(parts)

    @property
    def result(self) -> str | None:
        results = self.of("execute_result")
        return results[-1]["data"]["text/plain"] if results else None


def run(kc, code: str, timeout: float = 120, **options) -> Cell:
    messages: list[dict] = []
    reply = kc.execute_interactive(code, output_hook=messages.append, timeout=timeout, **options)
    return Cell(reply, messages)


def run_interrupted(km, kc, code: str, started: Callable[[dict], bool], timeout: float = 30,
                    again_every: float | None = None) -> Cell:
    """Run ``code`` and interrupt the kernel once, when a message it shows says ``started``: the
    cell runs in its sandbox by then. An interrupt sent on a timer instead can reach a kernel or
    a sandbox that has not started the cell yet, where there is nothing to stop; the cell then runs
    its full course. ``again_every``: interrupt again every so many seconds until the cell ends, as
    a person presses Interrupt again (for a reference kernel that can miss one)."""
    messages: list[dict] = []
    sent = threading.Event()
    ended = threading.Event()

    def again() -> None:
        while not ended.wait(again_every):
            km.interrupt_kernel()

    def hook(msg: dict) -> None:
        messages.append(msg)
        if not sent.is_set() and started(msg):
            sent.set()
            km.interrupt_kernel()
            if again_every:
                threading.Thread(target=again, daemon=True).start()

    try:
        reply = kc.execute_interactive(code, output_hook=hook, timeout=timeout)
    finally:
        ended.set()
    return Cell(reply, messages)


def printed(text: str) -> Callable[[dict], bool]:
    """A ``started`` for ``run_interrupted``: the cell printed ``text``."""
    return lambda msg: msg["msg_type"] == "stream" and text in msg["content"]["text"]


def head_of(kc) -> str:
    return run(kc, "%forkd head").result.split()[1]
