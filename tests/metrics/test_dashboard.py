"""The Grafana dashboard under examples/ reads only metrics the server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest

from shoal.metrics import PrometheusStatLogger

DASHBOARD = Path(__file__).parents[2] / "examples" / "grafana" / "shoal_dashboard.json"


def test_dashboard_queries_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"shoal:[a-z_]+", e)}
    assert len(used) >= 15
    text = generate_latest(PrometheusStatLogger("m", cache_info={"block_size": "16"}).registry)
    exported = set(re.findall(r"^(?:# HELP )?(shoal:[a-z_]+)", text.decode(), re.M))
    assert used <= exported, used - exported
