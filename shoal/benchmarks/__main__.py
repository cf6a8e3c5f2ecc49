"""`python -m shoal.benchmarks serve|throughput|latency ...`: the same as `shoal bench ...`."""

from __future__ import annotations

import argparse
import logging
import sys

from shoal.benchmarks.commands import add_bench_commands, run_bench_command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shoal.benchmarks")
    parser.add_argument("--log-level", default="INFO")
    add_bench_commands(parser)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        return run_bench_command(ns)
    except ValueError as e:
        print(f"shoal bench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
