"""Linear-time matchers agree with naive ones; renderer keys are canonical."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from renderer_actors.key import RendererKey
from renderer_actors.matching import TurnIndex, find_all, find_first, prefix_hashes
from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.wire import RendererConfig

# A small alphabet makes repeats (the cases failure tables exist for) common.
sequences = st.lists(st.integers(0, 2), max_size=40)
patterns = st.lists(st.integers(0, 2), min_size=1, max_size=6)


def naive_find_all(text, pattern):
    return [i for i in range(len(text) - len(pattern) + 1) if text[i : i + len(pattern)] == pattern]


@settings(max_examples=300, deadline=None)
@given(text=sequences, pattern=patterns, start=st.integers(0, 10))
def test_failure_table_matcher_agrees_with_naive_search(text, pattern, start):
    expected = [i for i in naive_find_all(text, pattern) if i >= start]
    assert find_all(text, pattern, start) == expected
    assert find_first(text, pattern, start) == (expected[0] if expected else -1)


messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool"]), "content": st.sampled_from("ab")}
    ),
    max_size=8,
)


def naive_parent(recorded, incoming):
    best = None
    for turn_id, before in recorded:
        n = len(before)
        if n < len(incoming) and incoming[:n] == before and (best is None or n > best[1]):
            best = (turn_id, n)
    return best


@settings(max_examples=200, deadline=None)
@given(histories=st.lists(messages, max_size=6), incoming=messages)
def test_turn_index_finds_the_parent_a_naive_scan_finds(histories, incoming):
    index = TurnIndex()
    recorded = []
    for i, before in enumerate(histories):
        if any(before == b for _, b in recorded):
            continue  # one turn per prefix: a later record for the same prefix replaces the earlier
        index.record(before, f"t{i}")
        recorded.append((f"t{i}", before))
    assert index.find_parent(incoming) == naive_parent(recorded, incoming)


def test_prefix_hashes_ignore_dict_order_but_not_content():
    a = [{"role": "user", "content": "x"}]
    b = [{"content": "x", "role": "user"}]
    c = [{"role": "user", "content": "y"}]
    assert prefix_hashes(a) == prefix_hashes(b)
    assert prefix_hashes(a)[-1] != prefix_hashes(c)[-1]


def test_configs_differing_only_in_multiplex_share_a_key():
    one = RendererKey.from_config("m", RendererConfig(multiplex=4, template_kwargs={"b": 1, "a": 2}))
    two = RendererKey.from_config("m", RendererConfig(multiplex=64, template_kwargs={"a": 2, "b": 1}))
    assert one.to_json() == two.to_json()
    assert RendererKey.from_json(one.to_json()) == one


def test_bundled_model_keys_resolve_auto_and_fill_template_defaults():
    auto = RendererKey.from_config(BUNDLED_MODEL, RendererConfig())
    explicit = RendererKey.from_config(
        "other",
        RendererConfig(tokenizer=BUNDLED_MODEL, family="qwen3", template_kwargs={"enable_thinking": True}),
    )
    assert auto.family == "qwen3" and auto.to_json() == explicit.to_json()
    assert RendererKey.from_config(BUNDLED_MODEL, RendererConfig(history="fork_on_rewrite")) != auto
