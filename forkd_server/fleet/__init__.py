"""The fleet: one ``/v1`` in front of many ``forkd serve`` hosts (``forkd router``).

Rooms: ``discovery`` (where the hosts are: ``--hosts`` or ``--hosts-dns``), ``state`` (the host
table and the pins, in SQLite), ``hosts`` (each host's connections, capacity and heartbeat),
``placement`` (which hosts get a spawn; pure), ``forks`` (a fork tree's children under ids unique
across the fleet), ``events`` (the merged event stream), ``router`` (the
decisions that need more than one host), ``handlers`` (the routes, a module per service) and
``session`` (the session WebSocket), ``app`` (``forkd router``'s start-up) and ``extension`` (the
router as a mode of the jupyter-server extension). Design: docs/design/fleet.md.
"""
