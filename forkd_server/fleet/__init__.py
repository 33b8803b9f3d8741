"""The fleet: one ``/v1`` in front of many ``forkd serve`` hosts (``forkd router``).

Rooms: ``state`` (the host table and the pins, in SQLite), ``hosts`` (each host's connections,
capacity and heartbeat), ``placement`` (which hosts get a spawn; pure), ``events`` (the merged event
stream), ``router`` (the decisions that need more than one host), ``handlers`` (a module per service) and ``session`` (the
routes), ``app`` (start-up). Design: docs/design/fleet.md.
"""
