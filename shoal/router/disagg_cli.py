"""`shoal proxy --prefill URL... --decode URL...`: flags and start-up (the app is
router/disagg.py, imported only when the proxy runs)."""

from __future__ import annotations

import argparse


def add_proxy_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill engine (shoal serve ... --kv-transfer-config with "
                        "kv_role kv_producer), http://host:port; repeat for each")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode engine (kv_role kv_consumer); repeat for each")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)


def run_proxy(ns: argparse.Namespace) -> int:
    import uvicorn

    from shoal.router.disagg import DisaggProxy, build_app

    app = build_app(DisaggProxy(ns.prefill, ns.decode))
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level.lower(),
                access_log=False)
    return 0
