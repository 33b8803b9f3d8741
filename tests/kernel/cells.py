"""Cells run through a real kernel's client, and what they showed."""

from __future__ import annotations


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


def head_of(kc) -> str:
    return run(kc, "%forkd head").result.split()[1]
