"""`shoal bench serve | throughput | latency`: the subcommands and their dispatch."""

from __future__ import annotations

import argparse


def add_bench_commands(bench: argparse.ArgumentParser) -> None:
    from shoal.benchmarks import latency, serve, throughput
    from shoal.benchmarks.presets import (
        LATENCY_PRESETS,
        SERVE_PRESETS,
        THROUGHPUT_PRESETS,
        describe,
    )

    sub = bench.add_subparsers(dest="bench_command", required=True)
    serve.add_flags(sub.add_parser(
        "serve", help="online serving load against an OpenAI-compatible server "
        "(flags, table and result keys of `vllm bench serve`)",
        epilog=f"presets: {describe(SERVE_PRESETS)}"))
    throughput.add_flags(sub.add_parser(
        "throughput", help="offline throughput through shoal.LLM",
        epilog=f"presets: {describe(THROUGHPUT_PRESETS)}"))
    latency.add_flags(sub.add_parser(
        "latency", help="latency of one batch through shoal.LLM",
        epilog=f"presets: {describe(LATENCY_PRESETS)}"))


def run_bench_command(ns: argparse.Namespace) -> int:
    if ns.bench_command == "serve":
        from shoal.benchmarks.serve import main
    elif ns.bench_command == "throughput":
        from shoal.benchmarks.throughput import main
    else:
        from shoal.benchmarks.latency import main
    return main(ns)
