"""The ``forkd`` command line."""

from __future__ import annotations

import argparse
import json
import sys


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    figures = run_demo(data_dir=args.data_dir, children=args.children, grandchildren=args.grandchildren,
                       mib=args.mib)
    if args.json:
        print(json.dumps(figures))
    checks = ("source_result_unchanged", "state_carried_to_grandchildren", "children_random_streams_distinct")
    return 0 if all(figures[c] for c in checks) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forkd", description="Fork-on-write Python sandboxes.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="snapshot, fork 10 children, branch a busy child, fork grandchildren")
    demo.add_argument("--data-dir", help="state directory (default: a temporary one, removed afterwards)")
    demo.add_argument("--children", type=int, default=10)
    demo.add_argument("--grandchildren", type=int, default=3)
    demo.add_argument("--mib", type=int, default=200, help="size of the array the snapshot holds")
    demo.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
