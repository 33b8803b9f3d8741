"""Cells run through a real kernel's client, and what they showed."""

from __future__ import annotations

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


def run_interrupted(km, kc, code: str, started: Callable[[dict], bool], timeout: float = 30) -> Cell:
    """Run ``code`` and interrupt the kernel once, when a message it shows says ``started``: the
    cell runs in its sandbox by then. An interrupt sent on a timer instead can reach a kernel or
    a sandbox that has not started the cell yet, where there is nothing to stop; the cell then runs
    its full course."""
    messages: list[dict] = []
    sent = False

    def hook(msg: dict) -> None:
        nonlocal sent
        messages.append(msg)
        if not sent and started(msg):
            sent = True
            km.interrupt_kernel()

    reply = kc.execute_interactive(code, output_hook=hook, timeout=timeout)
    return Cell(reply, messages)


def printed(text: str) -> Callable[[dict], bool]:
    """A ``started`` for ``run_interrupted``: the cell printed ``text``."""
    return lambda msg: msg["msg_type"] == "stream" and text in msg["content"]["text"]


def head_of(kc) -> str:
    return run(kc, "%forkd head").result.split()[1]
