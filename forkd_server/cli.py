"""The ``forkd`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    figures = run_demo(data_dir=args.data_dir, children=args.children, grandchildren=args.grandchildren,
                       mib=args.mib)
    if args.json:
        print(json.dumps(figures))
    checks = ("source_result_unchanged", "state_carried_to_grandchildren", "children_random_streams_distinct")
    return 0 if all(figures[c] for c in checks) else 1


def cmd_image_build(args) -> int:
    """Build (or reuse) the VM engine's guest image under the data dir: kernel + initramfs."""
    import time

    from forkd_engine.vm.image import ImageError, build_image

    data_dir = os.path.expanduser(args.data_dir or os.environ.get("FORKD_DATA_DIR")
                                  or os.path.join(os.path.expanduser("~"), ".local", "share", "forkd"))
    t0 = time.monotonic()
    try:
        image = build_image(os.path.join(data_dir, "vm", "cache"),
                            log=None if args.json else lambda msg: print(msg, file=sys.stderr))
    except ImageError as exc:
        print(f"forkd image build: {exc}", file=sys.stderr)
        return 1
    out = dict(image.to_dict(), seconds=round(time.monotonic() - t0, 2))
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return 0


def add_image_command(sub) -> None:
    image = sub.add_parser("image", help="the VM engine's guest image").add_subparsers(dest="image_command",
                                                                                      required=True)
    p = image.add_parser("build", help="build (or reuse, when its inputs are unchanged) the guest kernel and "
                                       "initramfs from Debian's packages, cached under the data dir")
    p.add_argument("--data-dir", help="state directory (default: $FORKD_DATA_DIR or ~/.local/share/forkd)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=cmd_image_build)


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
    add_image_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
