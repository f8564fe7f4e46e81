"""LoRA adapters on the shared stand-in servers, for tests."""

from __future__ import annotations

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

from renderer_actors.tokenizer import BUNDLED_MODEL


def unload_adapters(endpoints: list[str]) -> None:
    """Leave the servers serving only the base model."""
    with httpx.Client(timeout=5, trust_env=False) as client:
        for url in endpoints:
            for card in client.get(f"{url}/models").json()["data"]:
                if card["id"] != BUNDLED_MODEL:
                    client.post(
                        f"{url.removesuffix('/v1')}/v1/unload_lora_adapter", json={"lora_name": card["id"]}
                    )


def served_models(url: str) -> set[str]:
    """The model names a server lists (the base model and every loaded adapter)."""
    with httpx.Client(timeout=5, trust_env=False) as client:
        return {card["id"] for card in client.get(f"{url}/models").json()["data"]}
