"""The controller's change feed: each change is an event for every listener and wakes every waiter."""

from __future__ import annotations

import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")


class ChangeFeed:
    def __init__(self) -> None:
        self._listeners: list[Callable[[dict], None]] = []
        self._changed = threading.Condition()

    def subscribe(self, listener: Callable[[dict], None]) -> Callable[[], None]:
        """Call ``listener(event)`` on every change; returns a function that unsubscribes."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def emit(self, kind: str, action: str, **data) -> None:
        event = {"kind": kind, "action": action, "time": time.time(), **data}
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - a broken listener must not break the controller
                pass
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, look: Callable[[], T | None], timeout: float) -> T | None:
        """Call ``look()`` now and after each change until it returns something (not None), which is
        returned; None when ``timeout`` seconds pass first. ``look`` may raise to end the wait."""
        deadline = time.monotonic() + timeout
        with self._changed:  # held while looking: a change between the look and the wait is not missed
            while True:
                found = look()
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)
