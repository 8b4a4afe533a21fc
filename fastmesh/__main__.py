"""The ``fastmesh`` command line: ``fastmesh info`` (also ``python -m fastmesh info``)."""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastmesh", description="fastmesh command line")
    commands = parser.add_subparsers(dest="command", required=True)
    info_parser = commands.add_parser("info", help="what was built and whether this install is usable")
    info_parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)

    if args.command == "info":
        from fastmesh import info

        return info.main(as_json=args.json)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
