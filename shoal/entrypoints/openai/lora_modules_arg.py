"""--lora-modules, parsed without the HTTP stack: server_launch.py reads the start-up
adapters before it spawns the engine (their MoE experts need slots at start-up,
shoal/lora/target_modules.py), lora_routes.py serves them."""

from __future__ import annotations

import json


def parse_lora_modules(items: list[str]) -> list[tuple[str, str, str | None]]:
    """--lora-modules entries, `name=path` or a JSON object {"name", "path",
    "base_model_name"?}: (name, path, base model name)."""
    modules = []
    for item in items:
        text = item.strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules: {item!r} is not valid JSON ({e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) \
                    or not isinstance(obj.get("path"), str):
                raise ValueError(f"--lora-modules: {item!r} needs string fields name and path")
            base = obj.get("base_model_name")
            modules.append((obj["name"], obj["path"], base if isinstance(base, str) else None))
        else:
            name, sep, path = text.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {item!r} is neither name=path nor a JSON "
                                 "object")
            modules.append((name, path, None))
    return modules
