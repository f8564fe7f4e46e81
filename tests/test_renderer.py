"""Renderer contracts on top of the `renderers` library, in-process (no Ray): keys, token-exact bridges,
explicit forks with reasons, synthetic closes, parsing, custom renderers by Ref."""

from __future__ import annotations

from typing import Any

import pytest
from family_tokenizers import template_variant

from renderer_actors.calls import BridgeRequest, History
from renderer_actors.config import RendererConfig
from renderer_actors.key import RendererKey
from renderer_actors.renderer import Renderer
from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.kernel import CallerError, Ref

IM_END = 151645
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
_LOADED: dict[str, Renderer] = {}


def renderer(model: str = BUNDLED_MODEL, allowed: tuple[str, ...] | None = None, **config: Any) -> Renderer:
    """One loaded renderer per (model, config), shared by the tests of this module."""
    key = RendererKey.from_config(model, RendererConfig(**config))
    cache_key = key.to_json() + repr(allowed)
    if cache_key not in _LOADED:
        _LOADED[cache_key] = Renderer.load(key, *(() if allowed is None else (allowed,)))
    return _LOADED[cache_key]


class Trajectory:
    """A session's bookkeeping, in-process: prompt, tail, messages, branch; answers needs_history."""

    def __init__(self, r: Renderer, messages: list[dict[str, Any]], tools=None) -> None:
        self.r, self.tools = r, tools
        self.prompt = r.start(messages, tools).prompt_ids
        self.tail = list(self.prompt)
        self.messages = list(messages)
        self.forks: list[str] = []

    def bridge(self, completion: list[int], new: list[dict[str, Any]]):
        request = BridgeRequest(
            completion_ids=completion, new_messages=new, tools=self.tools, prompt_tail=self.tail
        )
        if self.r.always_needs_history:
            request.history = History(messages=self.messages, prompt_ids=self.prompt)
        reply = self.r.bridge(request)
        if reply.needs_history:
            request.history = History(messages=self.messages, prompt_ids=self.prompt)
            reply = self.r.bridge(request)
        before = self.prompt + completion
        if reply.forked:
            self.prompt = self.tail = list(reply.prompt_ids)
            self.forks.append(reply.fork_reason)
        else:
            self.prompt = before + reply.appended_ids
            self.tail = list(reply.appended_ids)
            assert self.prompt[: len(before)] == before
        self.messages += [reply.assistant_message, *new]
        return reply


# ------------------------------------------------------------------------------------------ keys


def test_key_is_the_library_config_canonicalised_and_ignores_multiplex():
    auto = RendererKey.from_config(BUNDLED_MODEL, RendererConfig(multiplex=4))
    explicit = RendererKey.from_config(
        "other-model",
        RendererConfig(tokenizer=BUNDLED_MODEL, family="bundled", template_kwargs={"enable_thinking": True}),
    )
    assert auto.family == "bundled" and auto.to_json() == explicit.to_json()
    assert auto.renderer_config == {
        "name": "bundled",
        "enable_thinking": True,
        "drop_past_reasoning": False,
        "thinking_retention": None,
    }
    assert RendererKey.from_config(BUNDLED_MODEL, RendererConfig(history="fork_on_rewrite")) != auto
    off = RendererKey.from_config(BUNDLED_MODEL, RendererConfig(template_kwargs={"enable_thinking": False}))
    assert off != auto
    assert RendererKey.from_config(BUNDLED_MODEL, RendererConfig(template_faithful=False)) != auto


def test_every_library_family_is_available_by_name_and_hub_models_resolve_automatically():
    from renderers.base import MODEL_RENDERER_MAP, RENDERER_REGISTRY, _populate_registry

    _populate_registry()
    for family in RENDERER_REGISTRY:
        assert RendererKey.from_config("m", RendererConfig(family=family)).family == family
    for model, family in MODEL_RENDERER_MAP.items():
        assert RendererKey.from_config(model, RendererConfig()).family == family
    unknown = RendererKey.from_config("/my/fine-tune", RendererConfig())
    assert unknown.family == "auto"  # resolved when the tokenizer loads (a chat template: `default`)


@pytest.mark.parametrize(
    "config",
    [
        {"family": "no-such-family"},
        {"family": "qwen3", "template_kwargs": {"drop_past_reasoning": True}},
        {"family": "qwen3", "options": {"enable_thinkin": True}},
        {"family": "gpt-oss", "thinking_retention": "all", "options": {"auto_drop_analysis": True}},
        {"family": "custom"},
        {"family": "qwen3", "custom": {"target": "renderer_actors.examples.chatml:ChatMLRenderer"}},
    ],
)
def test_settings_the_library_refuses_are_the_callers_mistake(config):
    with pytest.raises(CallerError):
        RendererKey.from_config("m", RendererConfig(**config))


def test_settings_are_exposed_through_our_config():
    key = RendererKey.from_config(
        "m",
        RendererConfig(
            family="glm-4.5", thinking_retention="all", template_kwargs={"enable_thinking": False}
        ),
    )
    assert key.renderer_config["thinking_retention"] == "all"
    assert key.renderer_config["enable_thinking"] is False
    default = RendererKey.from_config(
        "m", RendererConfig(family="default", options={"tool_parser": "qwen3"}, template_kwargs={"x": 1})
    )
    assert default.renderer_config["tool_parser"] == "qwen3" and default.renderer_config["x"] == 1


# --------------------------------------------------------------------------------------- bridges


def test_tool_turns_extend_through_the_library_bridge_token_exactly():
    r = renderer()
    t = Trajectory(r, [{"role": "user", "content": "find json"}], TOOLS)
    completion = r.encode(
        '<think>\nlook\n</think>\n\n<tool_call>\n{"name": "search", "arguments": {"q": "json"}}\n</tool_call>'
    ) + [IM_END]
    reply = t.bridge(completion, [{"role": "tool", "content": "found"}])
    assert not reply.forked and not reply.synthetic_close and not t.forks
    full = r.render_ids(t.messages, TOOLS, True)
    assert t.prompt == full  # the library's extension is exactly the template's render here


@pytest.mark.parametrize(
    "config",
    [{"family": "qwen3"}, {"template_kwargs": {"drop_past_reasoning": True}}],
    ids=["qwen3", "bundled"],
)
def test_a_new_user_turn_after_reasoning_forks_with_the_reason_when_the_template_drops_it(config):
    """Qwen3's template (and the bundled one with `drop_past_reasoning`) drops reasoning before the last
    user message: the library cannot bridge, a full render does not start with the trajectory, so it
    forks explicitly and says where."""
    r = renderer(**config)
    t = Trajectory(r, [{"role": "user", "content": "hi"}])
    completion = r.encode("<think>\nhmm\n</think>\n\nhello") + [IM_END]
    before = t.prompt + completion
    reply = t.bridge(completion, [{"role": "user", "content": "again"}])
    assert reply.forked and "differently from token" in reply.fork_reason and "<think>" in reply.fork_reason
    assert (
        reply.prompt_ids == r.render_ids(t.messages, None, True) and reply.prompt_ids[: len(before)] != before
    )


def test_thinking_retention_all_keeps_sampled_reasoning_across_user_turns():
    r = renderer(thinking_retention="all")
    t = Trajectory(r, [{"role": "user", "content": "hi"}])
    completion = r.encode("<think>\nhmm\n</think>\n\nhello") + [IM_END]
    reply = t.bridge(completion, [{"role": "user", "content": "again"}])
    assert not reply.forked and r.decode(t.prompt).count("hmm") == 1


def test_fork_on_rewrite_forks_where_the_library_extends_but_the_template_rewrites():
    r = renderer(family="qwen3", thinking_retention="all", history="fork_on_rewrite")
    t = Trajectory(r, [{"role": "user", "content": "hi"}])
    completion = r.encode("<think>\nhmm\n</think>\n\nhello") + [IM_END]
    reply = t.bridge(completion, [{"role": "user", "content": "again"}])
    assert reply.forked and reply.fork_reason.startswith("fork_on_rewrite")


@pytest.mark.parametrize("family", ["qwen3", "default"])
def test_nfd_text_and_a_non_canonical_split_do_not_fork_under_fork_on_rewrite(family):
    """Defect 1: the template rewrote nothing; a decomposed message and a completion split "js"+"on" must
    not look like a rewrite (both sides are compared as the tokenizer normalises them)."""
    r = renderer(family=family, history="fork_on_rewrite")
    t = Trajectory(r, [{"role": "user", "content": "cafe\u0301 json"}])
    split = r.encode("The word is js") + r.encode("on, cafe\u0301.")
    assert split != r.encode("The word is json, cafe\u0301.")  # really non-canonical
    for turn in range(3):
        reply = t.bridge(split + [IM_END], [{"role": "user", "content": f"more cafe\u0301 {turn}"}])
        assert not reply.forked, reply.fork_reason
    assert t.forks == []


NUMBERED = (
    "{% for m in messages %}<|im_start|>{{ m.role }} #{{ loop.index }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant #{{ messages|length + 1 }}\n{% endif %}"
)
LATEST_MARKED = (
    "{% for m in messages %}<|im_start|>{{ m.role }}{% if loop.last and m.role == 'user' %} (latest)"
    "{% endif %}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_append_renders_new_messages_in_their_real_position_for_a_numbered_template():
    """Defect 2: under `append`, a template whose text depends on position gets the real conversation,
    checked against a full render, never a delta after a synthetic prefix."""
    r = renderer(template_variant("numbered", NUMBERED), family="default")
    t = Trajectory(r, [{"role": "system", "content": "s"}, {"role": "user", "content": "one"}])
    for turn in range(3):
        reply = t.bridge(r.encode(f"answer {turn}") + [IM_END], [{"role": "user", "content": f"q{turn}"}])
        assert not reply.forked
        assert t.prompt == r.render_ids(t.messages, None, True)
    assert "<|im_start|>user #8\nq2<|im_end|>\n<|im_start|>assistant #9\n" in r.decode(t.prompt)


def test_append_forks_and_says_why_when_a_position_dependent_template_rewrites_history():
    r = renderer(template_variant("latest", LATEST_MARKED), family="default")
    t = Trajectory(r, [{"role": "user", "content": "one"}])
    reply = t.bridge(r.encode("answer") + [IM_END], [{"role": "user", "content": "two"}])
    assert reply.forked and "(latest)" in reply.fork_reason
    assert reply.prompt_ids == r.render_ids(t.messages, None, True)


def test_a_length_cut_in_open_reasoning_gets_the_familys_canonical_close_marked_synthetic():
    r = renderer()
    t = Trajectory(r, [{"role": "user", "content": "hi"}], TOOLS)
    cut = r.encode("<think>\nstill thinking about")
    before = t.prompt + cut
    reply = t.bridge(cut, [{"role": "tool", "content": "x"}])
    assert reply.synthetic_close and not reply.forked
    assert t.prompt[: len(before)] == before
    assert r.decode(reply.appended_ids).startswith("</think><|im_end|>\n<|im_start|>user")
    # The whole close is counted, through the stop token: both ids are prompt, never sampled.
    assert r.decode(reply.appended_ids[: reply.synthetic_ids]) == "</think><|im_end|>"


def test_assistant_messages_in_new_messages_are_refused():
    r = renderer()
    with pytest.raises(ValueError, match="assistant"):
        r.bridge(
            BridgeRequest(
                completion_ids=[IM_END], new_messages=[{"role": "assistant", "content": "x"}], prompt_tail=[1]
            )
        )


# ----------------------------------------------------------------------------------------- parse


def test_parse_reports_each_tool_call_status_and_keeps_sampled_argument_text():
    r = renderer()
    body = (
        '<tool_call>\n{"name": "search", "arguments": {"q":  "spaced"}}\n</tool_call>\n'
        "<tool_call>\n{not json}\n</tool_call>\n"
        '<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arg'
    )
    parsed = r.parse(r.encode(body), TOOLS)
    # Tool names are checked only where the family's inference parser checks them (GLM, as vLLM does).
    assert [c.status for c in parsed.tool_calls] == ["ok", "invalid_json", "ok", "unclosed"]
    calls = parsed.message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["search", "other"]
    assert calls[0]["function"]["arguments"] == '{"q":  "spaced"}'  # as sampled, not re-serialised
    assert not parsed.closed


def test_parse_finds_markers_by_id_not_by_text():
    r = renderer()
    text_marker = r.encode("<tool") + r.encode("_call>")  # the text, not the special token
    parsed = r.parse(text_marker + [IM_END], TOOLS)
    assert parsed.tool_calls == [] and parsed.closed


# ------------------------------------------------------------------------------ custom renderers


def test_a_custom_renderer_named_by_ref_loads_under_the_renderer_allowlist():
    ref = Ref("renderer_actors.examples.chatml:ChatMLRenderer", {"system_prompt": "Be terse."})
    r = renderer(family="custom", custom=ref)
    assert r.family == "custom:renderer_actors.examples.chatml:ChatMLRenderer"
    t = Trajectory(r, [{"role": "user", "content": "hi"}])
    assert r.decode(t.prompt).startswith("<|im_start|>system\nBe terse.<|im_end|>")
    reply = t.bridge(r.encode("hello"), [{"role": "user", "content": "again"}])
    assert reply.synthetic_close and not reply.forked
    assert t.prompt == r.render_ids(t.messages, None, True)


@pytest.mark.parametrize(
    "target",
    [
        "rollout_actors.kernel:RefResolver",  # outside the renderer allowlist
        "renderer_actors.examples.chatml:ChatMLRendererConfig",  # allowed module, not marked as a renderer
        "renderers.qwen3:Qwen3Renderer",  # importable, but only the allowlist decides
    ],
)
def test_custom_renderers_outside_the_allowlist_or_unmarked_are_refused(target):
    key = RendererKey.from_config(BUNDLED_MODEL, RendererConfig(family="custom", custom=Ref(target)))
    with pytest.raises(CallerError):
        Renderer.load(key)
