"""Loading a tokenizer that is not in local files: the hub is asked for a bounded time, and not at all where
the machine already says it cannot be reached (docs/design.md contract 8: nothing waits on a network that is not
there). Real sockets, no hub: the endpoint is pointed at ports on this machine."""

from __future__ import annotations

import socket

import pytest
from huggingface_hub import constants

from renderer_actors.tokenizer import TokenizerUnavailable, _from_hub, hub_unreachable


@pytest.fixture
def no_proxy(monkeypatch):
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # bound, never listening: refused once closed


def test_an_unreachable_hub_fails_the_load_at_once_without_asking_it(monkeypatch, no_proxy):
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    asked: list[str] = []
    with pytest.raises(TokenizerUnavailable, match="hub is unreachable") as refused:
        _from_hub("org/model", asked.append, timeout_s=30)
    assert asked == [] and "cannot be reached" in str(refused.value)


def test_a_name_that_does_not_resolve_and_offline_mode_are_unreachable(monkeypatch, no_proxy):
    monkeypatch.setattr(constants, "ENDPOINT", "https://no-such-host.invalid")
    assert "cannot be reached" in hub_unreachable(5)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub_unreachable(5) == "HF_HUB_OFFLINE is set"


def test_a_listening_hub_or_a_proxy_is_asked_within_the_bound(monkeypatch, no_proxy):
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{listening.getsockname()[1]}")
        assert hub_unreachable(5) is None
        asked: list[str] = []
        assert (
            _from_hub("org/model", lambda name: asked.append(name) or "tokenizer", timeout_s=30)
            == "tokenizer"
        )
        assert asked == ["org/model"]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert hub_unreachable(5) is None  # only the proxy knows: the bounded wait decides
