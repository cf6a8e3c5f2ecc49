"""The tiers below the CPU tier, fastest first: each one's name and its builder.

A builder is named by "module:function" and imported only when offloading is on, so this
list stays light: request validation (request_params.py) reads the names from here without
loading torch. It takes a `tier.TierContext` and returns the tier, or None when the settings
leave it off (no disk path: no disk tier). A new tier is a module with a `LowerTier` subclass
and its builder, plus one line here."""

from __future__ import annotations

LOWER_TIERS: dict[str, str] = {
    "disk": "shoal.kv_offload.disk_tier:build_disk_tier",
}

# Every name a request may list in kv_transfer_params["skip_tiers"]. A known list rather than
# the tiers one engine has configured: SamplingParams are checked in the frontend, which does
# not know them, and skipping a tier the engine lacks is harmless (a typo is not).
TIER_NAMES: tuple[str, ...] = ("cpu", *LOWER_TIERS)
