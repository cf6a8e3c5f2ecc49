"""`--plot`: one PNG with the latency distributions and the throughput over time.

matplotlib is imported only here (the `bench` extra), so the load generator itself runs
without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from shoal.benchmarks.metrics import tokens_over_time
from shoal.benchmarks.request_funcs import RequestOutput


def plot_result(outputs: Sequence[RequestOutput], res: dict[str, Any], path: str,
                title: str = "") -> None:
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib (pip install 'shoal[bench]')") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [o for o in outputs if o.success]
    lens = [n for o, n in zip(outputs, res["output_lens"]) if o.success]
    series = {
        "TTFT (ms)": [o.ttft * 1000 for o in ok],
        "TPOT (ms)": [(o.latency - o.ttft) * 1000 / (n - 1) for o, n in zip(ok, lens) if n > 1],
        "ITL (ms)": [x * 1000 for o in ok for x in o.itl],
        "E2E latency (ms)": [o.latency * 1000 for o in ok],
    }
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (name, values) in zip(axes.flat, series.items()):
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 4)), color="tab:blue")
            for p, style in ((50, "--"), (99, ":")):
                v = float(np.percentile(values, p))
                ax.axvline(v, color="tab:red", linestyle=style, label=f"p{p} {v:.1f}")
            ax.legend(fontsize=8)
        ax.set_title(f"{name}, n={len(values)}")
        ax.set_xlabel(name)
        ax.set_ylabel("count")
    all_lens = [n if o.success else 0 for o, n in zip(outputs, res["output_lens"])]
    bucket = min(1.0, max(0.01, float(res["duration"]) / 100))  # about 100 points
    tok_s, running = tokens_over_time(outputs, all_lens, bucket)
    t = np.arange(len(tok_s)) * bucket
    ax = axes.flat[4]
    ax.plot(t, tok_s, color="tab:green")
    ax.set_title(f"output tokens/s (mean {res['output_throughput']:.1f})")
    ax.set_xlabel("seconds from the first request")
    ax.set_ylabel("tokens/s")
    ax = axes.flat[5]
    ax.plot(t, running, color="tab:orange")
    ax.set_title("requests in flight")
    ax.set_xlabel("seconds from the first request")
    ax.set_ylabel("requests")
    fig.suptitle(title or "shoal bench serve")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
