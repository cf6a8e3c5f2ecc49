"""The server's own settings (everything `shoal serve` takes besides engine arguments).

Like EngineArgs, each field carries its flag's help text: shoal.entrypoints.cli_args turns
the fields into `shoal serve` flags, so a new setting is one field here. The names are vLLM's,
so a `vllm serve` command line works unchanged."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

METRIC_PREFIXES = ("vllm", "shoal")


def setting(default: Any, help: str, **flag: Any) -> Any:
    """A field with its flag's help text; `flag` holds extra argparse options (nargs,
    choices)."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass
class ServerSettings:
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    uds: str | None = setting(None, "listen on this unix domain socket instead of host:port")
    root_path: str | None = setting(None, "the path prefix a proxy in front of the server "
                                          "strips (FastAPI's root_path); routes answer with "
                                          "and without it")
    api_key: str | None = setting(None, "require 'Authorization: Bearer <key>' on every route "
                                        "that runs the model or the tokenizer (default: the "
                                        "VLLM_API_KEY environment variable, as vLLM)")
    served_model_name: list[str] | None = setting(
        None, "the model name(s) clients use (the first one is reported; default: the model "
              "argument)", nargs="+")
    api_server_count: int = setting(1, "API server processes over the one engine core, each "
                                       "with its own event loop, all on --host/--port "
                                       "(SO_REUSEPORT: the kernel shares connections out)")
    shutdown_timeout: float = setting(30.0, "seconds to let in-flight requests finish after "
                                            "SIGTERM; then they end with an error (0: at once)")
    uvicorn_log_level: str = setting("info", "uvicorn's log level", choices=[
        "critical", "error", "warning", "info", "debug", "trace"])
    disable_uvicorn_access_log: bool = setting(False, "no access log line per request")
    enable_request_id_headers: bool = setting(False, "answer every request with an "
                                                     "X-Request-Id header (the client's own, "
                                                     "else a new one)")
    enable_server_load_tracking: bool = setting(False, "count the requests in flight and "
                                                       "report them at GET /load")
    enable_force_include_usage: bool = setting(False, "end every stream with a usage chunk, "
                                                      "asked for or not")
    enable_prompt_tokens_details: bool = setting(False, "report usage.prompt_tokens_details "
                                                        "(cached prompt tokens)")
    enable_tokenizer_info_endpoint: bool = setting(False, "serve GET /tokenizer_info (the "
                                                          "tokenizer's configuration and chat "
                                                          "template)")
    return_tokens_as_token_ids: bool = setting(False, "show logprob tokens as 'token_id:N' "
                                                      "unless a request says otherwise")
    metrics_prefixes: list[str] = setting(
        METRIC_PREFIXES, "the Prometheus name prefixes exported: vllm (dashboards made "
                               "for vLLM work unchanged), shoal, or both", nargs="+",
        choices=list(METRIC_PREFIXES))
    show_hidden_metrics_for_version: str | None = setting(
        None, "also export metrics deprecated since this version (vLLM's flag; shoal has "
              "deprecated none, so every metric is shown either way)")
    lora_modules: list[str] | None = setting(
        None, "LoRA adapters to serve (needs --enable-lora), each name=path or a JSON object "
              '\'{"name": ..., "path": ..., "base_model_name": ...}\'; a request picks one by '
              "its model name", nargs="+")
    grpc_port: int | None = setting(None, "also serve the gRPC control plane "
                                          "(shoal/entrypoints/grpc/shoal_engine.proto) on "
                                          "--host at this port, over the same engine and "
                                          "--api-key (0 or unset: off)")
    grpc_ssl_certfile: str | None = setting(None, "serve gRPC over TLS: the server's "
                                                  "certificate chain (PEM; with "
                                                  "--grpc-ssl-keyfile). Plaintext clients "
                                                  "are then refused")
    grpc_ssl_keyfile: str | None = setting(None, "the private key (PEM) of "
                                                 "--grpc-ssl-certfile")
    grpc_ssl_ca_certs: str | None = setting(None, "mutual TLS for gRPC: clients must present "
                                                  "a certificate these CA certificates (PEM) "
                                                  "sign; --api-key still applies")
    max_stored_responses: int = setting(1000, "Responses API: how many responses are kept in "
                                              "memory for previous_response_id (oldest dropped)")

    enable_auto_tool_choice: bool = setting(False, 'let tool_choice "auto" parse tool calls '
                                                   "from the model's text (needs "
                                                   "--tool-call-parser)")
    tool_call_parser: str | None = setting(None, "the model's tool call format: hermes, "
                                                 "llama3_json, mistral, qwen3_xml, pythonic "
                                                 "or openai (gpt-oss)")
    reasoning_parser: str | None = setting(None, "split reasoning_content from content: qwen3, "
                                                 "deepseek_r1 or openai_gptoss")

    def __post_init__(self) -> None:
        from shoal.structured_output.parsers import get_reasoning_parser, get_tool_parser

        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # an unknown name fails at start-up
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)
        if self.api_key is None:
            self.api_key = os.environ.get("VLLM_API_KEY") or None
        if not 1 <= self.api_server_count <= 64:
            raise ValueError(f"--api-server-count must be in 1..64 (got "
                             f"{self.api_server_count})")
        if self.root_path:
            self.root_path = "/" + self.root_path.strip("/")
        self.metrics_prefixes = list(self.metrics_prefixes)
        bad = sorted(set(self.metrics_prefixes) - set(METRIC_PREFIXES))
        if bad or not self.metrics_prefixes:
            raise ValueError(f"metrics_prefixes must be some of {', '.join(METRIC_PREFIXES)} "
                             f"(got {self.metrics_prefixes})")
        if self.grpc_port is not None and not 0 <= self.grpc_port <= 65535:
            raise ValueError(f"grpc_port must be in 0..65535 (got {self.grpc_port})")
        self._check_grpc_tls()
        if self.max_stored_responses < 0:
            raise ValueError("max_stored_responses must be >= 0")

    def _check_grpc_tls(self) -> None:
        """The TLS flags come as a set (the files are read when the gRPC server starts)."""
        cert, key = self.grpc_ssl_certfile, self.grpc_ssl_keyfile
        if (cert is None) != (key is None):
            given, missing = (("grpc_ssl_certfile", "grpc_ssl_keyfile") if key is None
                              else ("grpc_ssl_keyfile", "grpc_ssl_certfile"))
            raise ValueError(f"{missing} must be set with {given}: TLS needs the "
                             f"certificate and its private key")
        if self.grpc_ssl_ca_certs is not None and cert is None:
            raise ValueError("grpc_ssl_ca_certs needs grpc_ssl_certfile and grpc_ssl_keyfile "
                             "(mutual TLS is TLS with client certificates)")
        if cert is not None and not self.grpc_port:
            raise ValueError("grpc_ssl_certfile needs grpc_port: the TLS flags configure the "
                             "gRPC control plane, which is off")
