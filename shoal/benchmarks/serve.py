"""`shoal bench serve`: online-serving load against any OpenAI-compatible server.

The flags, the summary table and the result JSON keys are those of `vllm bench serve`, so the
same command line measures shoal and vLLM (or anything else speaking the OpenAI API) the
same way:

    shoal bench serve --base-url http://127.0.0.1:8000 --dataset-name random \\
        --random-input-len 256 --random-output-len 64 --num-prompts 64 \\
        --max-concurrency 16 --ignore-eos --save-result --result-dir results/

Additions: `--non-streaming` (one JSON answer per request: TTFT = E2EL), `--preset`
(the workloads of BENCHMARKS.md), `--num-client-processes` (split the requests over
several client processes when one cannot parse the event rate), `--plot` (a PNG), and
`--token-id-prompts`. Arrivals: all at once for `--request-rate inf`, else gaps drawn from a
gamma distribution (shape `--burstiness`, 1 = Poisson) with its own seeded generator, then
scaled so the last request arrives at num_prompts / rate, as vLLM does.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import sys
from datetime import datetime
from typing import Any

from shoal.benchmarks.datasets import SampleRequest, add_dataset_flags, get_samples
from shoal.benchmarks.http_client import HTTPClient
from shoal.benchmarks.load import (
    Progress,
    arrival_times,
    make_client,
    run_multiprocess,
    run_requests,
)
from shoal.benchmarks.metrics import (
    DETAIL_KEYS,
    METRICS,
    calculate_metrics,
    parse_goodput,
    summary_lines,
)
from shoal.benchmarks.presets import SERVE_PRESETS, apply_serve_preset
from shoal.benchmarks.request_funcs import ENDPOINTS, RequestInput, RequestOutput

logger = logging.getLogger(__name__)


def add_flags(p: argparse.ArgumentParser) -> None:
    add_dataset_flags(p)
    p.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    p.add_argument("--backend", default=None, help="recorded in the result; default: openai "
                   "for /v1/completions, openai-chat for /v1/chat/completions")
    p.add_argument("--label", default=None, help="result file prefix (default: the backend)")
    p.add_argument("--model", default=None, help="default: the first model /v1/models lists")
    p.add_argument("--served-model-name", default=None,
                   help="the model name sent in requests (default: --model)")
    p.add_argument("--tokenizer", default=None,
                   help="known name, .gguf file or folder (default: the model's)")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="no tokenizer: random prompts go as token ids")
    p.add_argument("--header", nargs="*", metavar="KEY=VALUE", help="extra request headers")
    p.add_argument("--insecure", action="store_true", help="skip TLS certificate checks")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--non-streaming", action="store_true",
                   help="ask for one JSON answer per request (TTFT = E2EL)")
    p.add_argument("--num-warmups", type=int, default=0,
                   help="untimed requests (copies of the first) before the run")
    p.add_argument("--num-client-processes", type=int, default=1,
                   help="client processes sharing the requests (round robin) and the "
                        "concurrency; timings are merged")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="metrics to print percentiles of (all four are always saved)")
    p.add_argument("--metric-percentiles", default="99", help="e.g. 50,90,99")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs in ms, e.g. ttft:500 tpot:50")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--save-detailed", action="store_true",
                   help="also save per-request arrays (ttfts, itls, output_lens, ...)")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--metadata", nargs="*", metavar="KEY=VALUE",
                   help="extra KEY=VALUE pairs for the result JSON")
    p.add_argument("--plot", nargs="?", const="", default=None, metavar="PNG",
                   help="write latency distributions and throughput over time as a PNG "
                        "(default path: beside the result file)")
    p.add_argument("--preset", default=None, choices=sorted(SERVE_PRESETS),
                   help="the requests of a BENCHMARKS.md workload")
    g = p.add_argument_group("sampling (sent only when given)")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--extra-body", type=json.loads, default=None,
                   help="JSON merged into every request body")


# -------------------------------------------------------------------------------------------
# Setup: model, tokenizer, requests


def _base_url(ns: argparse.Namespace) -> str:
    if ns.base_url:
        return ns.base_url.rstrip("/")
    host = f"[{ns.host}]" if ":" in ns.host else ns.host
    return f"http://{host}:{ns.port}"


def _headers(ns: argparse.Namespace) -> dict[str, str]:
    headers = {}
    if os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
    for item in ns.header or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--header takes KEY=VALUE, got {item!r}")
        headers[key.strip()] = value.strip()
    return headers


async def first_model(client: HTTPClient) -> tuple[str, str | None]:
    """(id, root) of the first model the server lists."""
    resp, body = await client.get_bytes("/v1/models")
    if resp.status != 200:
        raise RuntimeError(f"GET /v1/models answered HTTP {resp.status}: {body[:200]!r}")
    data = json.loads(body).get("data") or []
    if not data:
        raise RuntimeError("the server lists no models")
    return data[0]["id"], data[0].get("root")


def load_tokenizer_for(name_or_path: str) -> Any:
    """shoal's resolution (known names, .gguf files, folders), then transformers' local cache.
    Cached per resolved path, so a name and its file share one load."""
    from shoal.loader import resolve_model

    try:
        key = str(resolve_model(name_or_path).path)
    except Exception:
        key = name_or_path
    return _load_tokenizer(key)


@functools.lru_cache(maxsize=4)
def _load_tokenizer(name_or_path: str) -> Any:
    from shoal.loader import load_tokenizer

    try:
        return load_tokenizer(name_or_path)
    except Exception as first:
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
        except Exception:
            raise ValueError(f"cannot load a tokenizer for {name_or_path!r} ({first}); pass "
                             "--tokenizer, or --skip-tokenizer-init to send token ids") from None


def build_inputs(samples: list[SampleRequest], model: str, ns: argparse.Namespace
                 ) -> list[RequestInput]:
    sampling = {k: v for k, v in (("temperature", ns.temperature), ("top_p", ns.top_p),
                                  ("top_k", ns.top_k), ("min_p", ns.min_p),
                                  ("repetition_penalty", ns.repetition_penalty))
                if v is not None}
    extra = {**sampling, **(ns.extra_body or {})} or None
    if ns.endpoint.endswith("chat/completions") and any(
            not isinstance(s.prompt, str) for s in samples):
        raise ValueError("the chat endpoint needs text prompts: drop --token-id-prompts / "
                         "--skip-tokenizer-init, or give --tokenizer")
    return [RequestInput(prompt=s.prompt, prompt_len=s.prompt_len,
                         output_len=s.expected_output_len, model=model, endpoint=ns.endpoint,
                         stream=not ns.non_streaming, ignore_eos=ns.ignore_eos,
                         extra_body=extra, request_id=f"bench-{s.request_id}")
            for s in samples]


def command_line(sub: str) -> str:
    """`shoal bench <sub> ...` as typed, whether run as `shoal bench` or `python -m`."""
    argv = sys.argv[1:]
    rest = argv[argv.index(sub) + 1:] if sub in argv else argv
    return " ".join(["shoal", "bench", sub, *rest])


def result_path(ns: argparse.Namespace, backend: str, model: str, stamp: str) -> str:
    if ns.result_filename:
        name = ns.result_filename
    else:
        conc = f"-concurrency{ns.max_concurrency}" if ns.max_concurrency is not None else ""
        name = (f"{ns.label or backend}-{ns.request_rate}qps{conc}-"
                f"{model.rstrip('/').split('/')[-1]}-{stamp}.json")
    return os.path.join(ns.result_dir, name) if ns.result_dir else name


# -------------------------------------------------------------------------------------------


async def _prepare(ns: argparse.Namespace, base_url: str, headers: dict[str, str]
                   ) -> tuple[str, str | None, Any]:
    client = make_client(base_url, headers, ns.insecure)
    try:
        root = None
        if ns.model is None:
            model, root = await first_model(client)
            print(f"model (first listed by the server): {model}")
        else:
            model = ns.model
    finally:
        await client.close()
    tokenizer_id = None if ns.skip_tokenizer_init else (ns.tokenizer or root or model)
    tokenizer = None
    if tokenizer_id is not None:
        try:
            tokenizer = load_tokenizer_for(tokenizer_id)
        except ValueError:
            if ns.tokenizer is not None or (ns.dataset_name != "random"
                                            and not ns.token_id_prompts):
                raise
            # Only the random dataset gets by without one (token ids); say so.
            logger.warning("no tokenizer for %r: sending random token ids", tokenizer_id)
            tokenizer_id = None
    return model, tokenizer_id, tokenizer


async def _single_process(base_url: str, headers: dict[str, str], ns: argparse.Namespace,
                          inputs: list[RequestInput], arrivals: list[float],
                          progress: Progress) -> tuple[list[RequestOutput], float]:
    client = make_client(base_url, headers, ns.insecure)
    try:
        if ns.num_warmups > 0:
            print(f"Warming up with {ns.num_warmups} requests...")
            warm = [inputs[0]] * ns.num_warmups
            await run_requests(client, warm, [0.0] * len(warm), ns.max_concurrency)
        outputs, start, end = await run_requests(client, inputs, arrivals, ns.max_concurrency,
                                                 on_done=progress.update)
    finally:
        await client.close()
    return outputs, end - start


def _check_flags(ns: argparse.Namespace) -> tuple[list[float], list[str]]:
    """The percentiles and metrics to print; raises ValueError on a bad flag value."""
    if ns.max_concurrency is not None and ns.max_concurrency <= 0:
        raise ValueError("--max-concurrency must be > 0")
    if ns.num_client_processes < 1:
        raise ValueError("--num-client-processes must be >= 1")
    percentiles = [float(p) for p in str(ns.metric_percentiles).split(",") if p.strip()]
    metrics = [m.strip() for m in ns.percentile_metrics.split(",") if m.strip()]
    bad = [m for m in metrics if m not in METRICS]
    if bad:
        raise ValueError(f"--percentile-metrics: unknown {bad}; choose from {list(METRICS)}")
    return percentiles, metrics


def _send_all(ns: argparse.Namespace, base_url: str, headers: dict[str, str],
              inputs: list[RequestInput], arrivals: list[float]
              ) -> tuple[list[RequestOutput], float]:
    """Warm-up requests, then every request, in this process or spread over several."""
    progress = Progress(len(inputs), ns.disable_tqdm)
    try:
        if ns.num_client_processes == 1:
            return asyncio.run(_single_process(base_url, headers, ns, inputs, arrivals,
                                               progress))
        if ns.num_warmups > 0:
            warm = [inputs[0]] * ns.num_warmups
            asyncio.run(_single_process(base_url, headers, argparse.Namespace(
                **{**vars(ns), "num_warmups": 0}), warm, [0.0] * len(warm),
                Progress(0, True)))
        return run_multiprocess(base_url, headers, ns.insecure, inputs, arrivals,
                                ns.max_concurrency, ns.num_client_processes, progress)
    finally:
        progress.close()


def _result_header(ns: argparse.Namespace, backend: str, model: str, tokenizer_id: str | None,
                   inputs: list[RequestInput], base_url: str, stamp: str) -> dict[str, Any]:
    """vLLM's result keys that describe the run, then shoal's additions and --metadata."""
    result: dict[str, Any] = {
        "date": stamp, "endpoint_type": backend, "backend": backend, "label": ns.label,
        "model_id": model, "tokenizer_id": tokenizer_id, "num_prompts": len(inputs),
        "request_rate": ns.request_rate if ns.request_rate != float("inf") else "inf",
        "burstiness": ns.burstiness, "max_concurrency": ns.max_concurrency,
        # shoal's additions
        "base_url": base_url, "endpoint": ns.endpoint, "stream": not ns.non_streaming,
        "ignore_eos": ns.ignore_eos, "dataset_name": ns.dataset_name,
        "preset": ns.preset, "seed": ns.seed, "num_client_processes": ns.num_client_processes,
        "sampling": inputs[0].extra_body if inputs else None,
        "command": command_line("serve"),
    }
    for item in ns.metadata or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata takes KEY=VALUE, got {item!r}")
        result[key.strip()] = value.strip()
    return result


def _write_outputs(ns: argparse.Namespace, result: dict[str, Any], outputs: list[RequestOutput],
                   res: dict[str, Any], path: str, title: str) -> None:
    """The --plot PNG and the --save-result JSON (per-request arrays only with
    --save-detailed)."""
    if ns.plot is not None:
        from shoal.benchmarks.plot import plot_result

        png = ns.plot or os.path.splitext(path)[0] + ".png"
        os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
        plot_result(outputs, res, png, title=title)
        print(f"plot: {png}")
    if not ns.save_detailed:
        for key in DETAIL_KEYS:
            result.pop(key, None)
    if ns.save_result:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(f"result: {path}")


def run(ns: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark as the flags say; print the summary; return the result dict."""
    preset = apply_serve_preset(ns)
    percentiles, metrics = _check_flags(ns)
    goodput = parse_goodput(ns.goodput)
    base_url, headers = _base_url(ns), _headers(ns)
    if ns.dataset_name == "random":
        ns.ignore_eos = True  # as vLLM: random prompts run to the requested length
        if ns.skip_tokenizer_init:
            ns.token_id_prompts = True
    model, tokenizer_id, tokenizer = asyncio.run(_prepare(ns, base_url, headers))
    if ns.dataset_name == "random" and tokenizer is None:
        ns.token_id_prompts = True
    samples = get_samples(ns, tokenizer, preset.random if preset else None)
    inputs = build_inputs(samples, ns.served_model_name or model, ns)
    arrivals = arrival_times(len(inputs), ns.request_rate, ns.burstiness, ns.seed)
    backend = ns.backend or ("openai-chat" if ns.endpoint.endswith("chat/completions")
                             else "openai")
    print(f"Traffic request rate: {ns.request_rate}")
    print(f"Burstiness factor: {ns.burstiness} "
          f"({'Poisson process' if ns.burstiness == 1.0 else 'Gamma distribution'})")
    print(f"Maximum request concurrency: {ns.max_concurrency}")
    outputs, duration = _send_all(ns, base_url, headers, inputs, arrivals)
    res = calculate_metrics(outputs, duration, percentiles, goodput or None, tokenizer)
    failed = [o.error for o in outputs if not o.success]
    if failed:
        print("Failed requests (first 10 errors):")
        for err in failed[:10]:
            print(f"  {err}")
    for line in summary_lines(res, metrics, percentiles, ns.max_concurrency, ns.request_rate,
                              bool(goodput)):
        print(line)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    result = _result_header(ns, backend, model, tokenizer_id, inputs, base_url, stamp) | res
    _write_outputs(ns, result, outputs, res, result_path(ns, backend, model, stamp),
                   f"{backend} {model} ({len(inputs)} requests, concurrency "
                   f"{ns.max_concurrency}, rate {ns.request_rate})")
    return result


def main(ns: argparse.Namespace) -> int:
    result = run(ns)
    return 0 if result["failed"] == 0 else 1
