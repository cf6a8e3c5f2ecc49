"""`shoal serve | generate | chat | run-batch | bench | router | proxy`: the command line (above entrypoints and benchmarks,
which it dispatches to)."""

from __future__ import annotations

import argparse
import logging
import sys

from shoal.entrypoints.cli_args import (
    add_engine_flags,
    add_run_batch_args,
    add_sampling_flags,
    add_serve_flags,
    sampling_params_from,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="shoal LLM inference engine")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_serve_flags(serve)

    gen = sub.add_parser("generate", help="complete prompts offline and print the results")
    gen.add_argument("--model", default=None)
    gen.add_argument("--prompt", action="append", required=True,
                     help="a prompt (repeat for several)")
    gen.add_argument("--n", type=int, default=1, help="completions per prompt")
    gen.add_argument("--chat", action="store_true", help="apply the chat template to the prompt")
    add_sampling_flags(gen, max_tokens=64)
    add_engine_flags(gen)

    chat = sub.add_parser("chat", help="chat interactively in the terminal")
    chat.add_argument("--model", default=None)
    chat.add_argument("--system", default=None, help="a system message")
    add_sampling_flags(chat, max_tokens=256)
    add_engine_flags(chat)

    add_run_batch_args(sub.add_parser(
        "run-batch", help="run an OpenAI batch file (JSONL) offline, as vLLM's run-batch"))

    from shoal.benchmarks.commands import add_bench_commands

    add_bench_commands(sub.add_parser(
        "bench", help="benchmarks: serve (online load), throughput (offline), latency"))
    from shoal.router.cli import add_router_flags

    add_router_flags(sub.add_parser(
        "router", help="a cache-aware proxy: requests to the backend holding their prefix"))
    from shoal.router.disagg_cli import add_proxy_flags

    add_proxy_flags(sub.add_parser(
        "proxy", help="prefill/decode disaggregation: prompts on prefill engines, answers "
                      "from decode engines"))
    return parser


def run_generate(ns: argparse.Namespace) -> int:
    from shoal.entrypoints.cli_args import engine_args_from
    from shoal.llm import LLM

    args = engine_args_from(ns)
    params = sampling_params_from(ns, ns.n)
    llm = LLM(**{k: v for k, v in vars(args).items()})
    if ns.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in ns.prompt], params,
                        use_tqdm=False)
    else:
        outs = llm.generate(ns.prompt, params, use_tqdm=False)
    for i, out in enumerate(outs):
        for c in out.outputs:
            if len(outs) > 1 or len(out.outputs) > 1:
                print(f"--- prompt {i}, completion {c.index} ({c.finish_reason})")
            print(c.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        if ns.command == "serve":
            from shoal.entrypoints.cli_args import engine_args_from, server_settings_from
            from shoal.entrypoints.openai.server_launch import run_server

            return run_server(engine_args_from(ns), server_settings_from(ns))
        if ns.command == "generate":
            return run_generate(ns)
        if ns.command == "run-batch":
            from shoal.entrypoints.openai.run_batch import run_from

            return run_from(ns)
        if ns.command == "router":
            from shoal.router.cli import run_router

            return run_router(ns)
        if ns.command == "proxy":
            from shoal.router.disagg_cli import run_proxy

            return run_proxy(ns)
        if ns.command == "bench":
            from shoal.benchmarks.commands import run_bench_command

            return run_bench_command(ns)
        from shoal.entrypoints.chat_cli import run_chat

        return run_chat(ns)
    except ValueError as e:  # bad flag values: say which, no traceback
        print(f"shoal: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
