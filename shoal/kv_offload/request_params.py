"""Per-request offloading options, carried in SamplingParams.kv_transfer_params (vLLM's name),
whose shape SamplingParams checks; the tier names are checked here, by the request validator
(shoal/engine/request_checks.py), since the tiers live at this level.

    SamplingParams(..., kv_transfer_params={"skip_tiers": ["disk"]})

`skip_tiers` lists tiers whose blocks this request must not use ("cpu", "disk": the names in
lower_tiers.py). Blocks of the lower tiers are staged through the CPU tier, so skipping "cpu"
skips every tier. It only filters what the request reads: stores happen when blocks are
evicted, independent of any one request."""

from __future__ import annotations

from typing import Any

from shoal.kv_offload.lower_tiers import TIER_NAMES


def check_tier_names(params: dict[str, Any] | None) -> None:
    """ValueError for a skip_tiers entry that names no tier (params: as SamplingParams
    normalized them)."""
    bad = [t for t in skip_tiers(params) if t not in TIER_NAMES]
    if bad:
        raise ValueError(f"kv_transfer_params.skip_tiers: unknown tier(s) {bad}; "
                         f"tiers are {', '.join(TIER_NAMES)}")


def skip_tiers(params: dict[str, Any] | None) -> tuple[str, ...]:
    return tuple(params.get("skip_tiers", ())) if params else ()
