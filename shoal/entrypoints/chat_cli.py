"""`shoal chat`: an interactive conversation in the terminal, tokens printed as they come."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from shoal.engine.llm_engine import LLMEngine
from shoal.engine.output_processor import OutputKind
from shoal.sampling_params import SamplingParams


def _stream_reply(engine: LLMEngine, request_id: str, out_file: TextIO) -> str:
    """Steps the engine until the request finishes, printing each delta."""
    text = []
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                for c in out.outputs:
                    if c.text:
                        text.append(c.text)
                        out_file.write(c.text)
                        out_file.flush()
    except KeyboardInterrupt:  # stop this reply, keep what was said
        engine.abort_request(request_id)
        out_file.write(" [interrupted]")
    out_file.write("\n")
    out_file.flush()
    return "".join(text)


def run_chat(ns: argparse.Namespace) -> int:
    from shoal.entrypoints.cli_args import engine_args_from, sampling_params_from

    engine = LLMEngine(engine_args_from(ns))
    system = [{"role": "system", "content": ns.system}] if ns.system else []
    return chat_loop(engine, sampling_params_from(ns), system, sys.stdin, sys.stdout)


def chat_loop(engine: LLMEngine, params: SamplingParams, messages: list[dict[str, str]],
              in_file: TextIO, out_file: TextIO) -> int:
    """Reads one user turn per line until EOF or Ctrl-C; the whole conversation is the prompt."""
    interactive = in_file.isatty()
    if interactive:
        out_file.write("Chat with the model; Ctrl-D or Ctrl-C to quit.\n")
    turn = 0
    try:
        while True:
            if interactive:
                out_file.write("> ")
                out_file.flush()
            line = in_file.readline()
            if not line:  # EOF
                break
            line = line.rstrip("\n")
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            rid = f"chat-{turn}"
            try:
                prompt = engine.inputs.process_chat(messages)
                engine.add_request(rid, prompt, params, kind=OutputKind.DELTA)
            except ValueError as e:  # e.g. the conversation outgrew max_model_len
                out_file.write(f"error: {e}\n")
                messages.pop()
                continue
            turn += 1
            reply = _stream_reply(engine, rid, out_file)
            messages.append({"role": "assistant", "content": reply})
    except KeyboardInterrupt:
        out_file.write("\n")
    return 0
