"""The ``fastmesh`` command line (also ``python -m fastmesh``): ``fastmesh info``, ``fastmesh bench``,
``fastmesh tune``."""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # The runner and the tuner own their options (``fastmesh bench --help``, ``fastmesh tune --help``).
        from fastmesh.bench import runner

        return runner.main(argv[1:])
    if argv[:1] == ["tune"]:
        from fastmesh import tune

        return tune.main(argv[1:])
    parser = argparse.ArgumentParser(prog="fastmesh", description="fastmesh command line")
    commands = parser.add_subparsers(dest="command", required=True)
    info_parser = commands.add_parser("info", help="what was built and whether this install is usable")
    info_parser.add_argument("--json", action="store_true", help="print the report as JSON")
    commands.add_parser("bench", help="the kernel benchmarks beside their baselines and bounds (fastmesh bench --help)")
    commands.add_parser(
        "tune", help="measure the plans of fused calls and keep them in the plan cache (fastmesh tune --help)"
    )
    args = parser.parse_args(argv)

    if args.command == "info":
        from fastmesh import info

        return info.main(as_json=args.json)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
