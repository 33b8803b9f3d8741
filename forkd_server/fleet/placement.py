"""Placement: which hosts get the children of ``spawn(tag, n)``. Pure: no I/O, no clock.

1. Hosts that hold ``tag`` come first (their pages are there: a child is a copy-on-write mapping,
   not a download). Among them the first choice is best-of-K: K of them at random, the one with the
   most free memory wins (so equal hosts share the load and one stale figure does not draw every
   spawn); the rest follow by free memory.
2. ``n`` goes to one host when its free slots (``max_sandboxes - sandboxes``) fit it, else it is
   split across hosts in that order. A host that states no cap takes whatever is left.
3. A VM snapshot may then go to hosts that do not hold it (they pull it from the store first); a
   process-engine snapshot never does: its template is a process on its host, so the answer is a
   refusal that says so and how to make the snapshot movable.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

BEST_OF = 2  # K


@dataclass(frozen=True)
class Candidate:
    host: str
    holds: bool            # holds the snapshot, ready
    engine: str | None     # the snapshot's engine there (None where it is not held)
    memory_free: int | None
    free_slots: int | None  # None: the host states no cap


@dataclass(frozen=True)
class Part:
    host: str
    n: int
    pull: bool  # the host must pull the snapshot from the store first


class NoRoom(Exception):
    """Not all ``n`` children fit: ``status`` 503, and the message says why and what to do."""

    status = 503

    def __init__(self, message: str, room: int):
        super().__init__(message)
        self.message, self.room = message, room


def _memory(c: Candidate) -> int:
    return c.memory_free if c.memory_free is not None else -1  # unknown after every known figure


def ranked(candidates: list[Candidate], rng: random.Random, k: int = BEST_OF) -> list[Candidate]:
    """Best-of-K first, then the others by free memory (most first)."""
    if not candidates:
        return []
    sample = rng.sample(candidates, min(k, len(candidates)))
    first = max(sample, key=_memory)
    rest = sorted((c for c in candidates if c is not first), key=_memory, reverse=True)
    return [first, *rest]


def place(tag: str, n: int, candidates: list[Candidate], rng: random.Random | None = None) -> list[Part]:
    """The parts of a spawn of ``n`` children of ``tag`` over ``candidates`` (the hosts that are up).
    Raises NoRoom when they do not fit; the caller answers 404 when no host holds ``tag`` at all."""
    rng = rng or random.Random()
    holders = [c for c in candidates if c.holds]
    movable = bool(holders) and all(c.engine == "vm" for c in holders)
    open_ = [c for c in candidates if c.free_slots != 0]
    order = ranked([c for c in open_ if c.holds], rng)
    if movable:
        order += ranked([c for c in open_ if not c.holds], rng)
    parts, left = [], n
    for c in order:
        take = left if c.free_slots is None else min(left, c.free_slots)
        if c is order[0] and (c.free_slots is None or c.free_slots >= n):
            return [Part(c.host, n, not c.holds)]
        if take:
            parts.append(Part(c.host, take, not c.holds))
            left -= take
        if not left:
            return parts
    room = n - left
    if not movable:
        where = ", ".join(f"{c.host} ({_slots(c)})" for c in holders)
        raise NoRoom(f"snapshot `{tag}` is a process-engine snapshot: it lives only on {where}, which has room "
                     f"for {room} of the {n} children asked\nprocess-engine snapshots are host-local and never "
                     f"move: spawn at most {room} now, or make it movable: create it with engine \"vm\" on hosts "
                     f"started with --store (other hosts then pull it from the store)", room)
    raise NoRoom(f"the fleet has room for {room} of the {n} children of `{tag}` asked "
                 f"({', '.join(f'{c.host}: {_slots(c)}' for c in candidates) or 'no host is up'})\n"
                 f"spawn fewer, wait for sandboxes to end, or add hosts", room)


def _slots(c: Candidate) -> str:
    return "no cap stated" if c.free_slots is None else f"{c.free_slots} free slots"


def pick_host(candidates: list[Candidate], rng: random.Random | None = None) -> Candidate | None:
    """Where a new object that is not a spawn goes (a snapshot created or pulled): best-of-K by free
    memory among the hosts that are up."""
    order = ranked(candidates, rng or random.Random())
    return order[0] if order else None
