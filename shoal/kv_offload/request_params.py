"""Per-request offloading options, carried in SamplingParams.kv_transfer_params (vLLM's name).

    SamplingParams(..., kv_transfer_params={"skip_tiers": ["disk"]})

`skip_tiers` lists tiers whose blocks this request must not use ("cpu", "disk": the names in
lower_tiers.py). Blocks of the lower tiers are staged through the CPU tier, so skipping "cpu"
skips every tier. It only filters what the request reads: stores happen when blocks are
evicted, independent of any one request."""

from __future__ import annotations

from typing import Any

from shoal.kv_offload.lower_tiers import TIER_NAMES

_KEYS = ("skip_tiers",)


def validate_kv_transfer_params(params: Any) -> dict[str, Any] | None:
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be a dict (got {params!r})")
    unknown = sorted(set(params) - set(_KEYS))
    if unknown:
        raise ValueError(f"kv_transfer_params: unknown key(s) {', '.join(map(str, unknown))}; "
                         f"known: {', '.join(_KEYS)}")
    skip = params.get("skip_tiers", [])
    if isinstance(skip, str) or not isinstance(skip, list | tuple | set | frozenset):
        raise ValueError(f"kv_transfer_params.skip_tiers must be a list of tier names (got {skip!r})")
    bad = [t for t in skip if t not in TIER_NAMES]
    if bad:
        raise ValueError(f"kv_transfer_params.skip_tiers: unknown tier(s) {bad}; "
                         f"tiers are {', '.join(TIER_NAMES)}")
    return {"skip_tiers": sorted(set(skip))}


def skip_tiers(params: dict[str, Any] | None) -> tuple[str, ...]:
    return tuple(params.get("skip_tiers", ())) if params else ()
