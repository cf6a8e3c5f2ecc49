"""Two result folders side by side (a before/after sweep of gpu_run.sh --trees): for every
JSON file in both, every numeric figure, before, after and after/before.

    python benchmarks/compare_results.py OUT/before OUT/after            # the headline figures
    python benchmarks/compare_results.py OUT/before OUT/after --all      # every number
    python benchmarks/compare_results.py A B --match 'tok_s|ready' --markdown

Figures are the leaves of the JSON, named by their path (`w1.json 0.output_tok_s`); what
describes the run (host, versions, dates, commands, lengths and counts) is left out. The
default keeps throughputs, ready times, TTFT/ITL/step times and ratios. Standard library."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

SKIP = re.compile(r"(^|\.)(host|versions|date|started|command|commands|commit|hardware|"
                  r"torch|transformers|shoal_source|engine_args|notes?|params|runs\.\d+\.|"
                  r"all_runs_\w+|latencies)(\.|$)")
HEADLINE = re.compile(r"tok_s|tok_per_s|throughput|ready_s|ttft|itl|tpot|step_ms|ms_per_step|"
                      r"_over_|speedup|(^|[._])ratio|fraction|elapsed|decode_ms")


def leaves(value: Any, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a JSON value by dotted path (bools left out)."""
    if isinstance(value, bool) or value is None:
        return {}
    if isinstance(value, (int, float)):
        return {prefix: float(value)}
    items = (value.items() if isinstance(value, dict)
             else enumerate(value) if isinstance(value, list) else ())
    out: dict[str, float] = {}
    for key, sub in items:
        out |= leaves(sub, f"{prefix}.{key}" if prefix else str(key))
    return out


def compare(before: Path, after: Path, pattern: re.Pattern[str] | None
            ) -> list[tuple[str, str, float, float, float | None]]:
    rows = []
    for path in sorted(before.glob("*.json")):
        other = after / path.name
        if not other.exists():
            print(f"(only in {before}: {path.name})", file=sys.stderr)
            continue
        a, b = (leaves(json.loads(p.read_text())) for p in (path, other))
        for key in sorted(set(a) & set(b)):
            if SKIP.search(key) or (pattern is not None and not pattern.search(key)):
                continue
            ratio = b[key] / a[key] if a[key] else None
            rows.append((path.stem, key, a[key], b[key], ratio))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--all", action="store_true", help="every numeric figure")
    p.add_argument("--match", default=None, help="a regex the figure's path must match")
    p.add_argument("--markdown", action="store_true", help="a Markdown table")
    args = p.parse_args(argv)
    pattern = re.compile(args.match) if args.match else None if args.all else HEADLINE
    rows = compare(args.before, args.after, pattern)
    sep = " | " if args.markdown else "  "
    header = ["part", "figure", args.before.name, args.after.name, "after/before"]
    if args.markdown:
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    else:
        print(sep.join(header))
    for part, key, a, b, ratio in rows:
        cells = [part, key, f"{a:.4g}", f"{b:.4g}", f"{ratio:.3f}" if ratio is not None else "-"]
        print(("| " + sep.join(cells) + " |") if args.markdown else sep.join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
