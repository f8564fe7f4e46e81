"""Renderer specification: token-exact bridging, parsing by ids, forks (DESIGN.md contract 7).

In-process: no Ray. "Sampled" completions are made by tokenising assistant text here, canonically or in
deliberately non-canonical splits (the ids of "js" + "on" where the tokenizer would say "json").
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from renderer_actors.key import RendererKey
from renderer_actors.renderer import (
    SCAFFOLD,
    BridgeRequest,
    History,
    Renderer,
    TrajectoryState,
    build_renderer,
)
from renderer_actors.tokenizer import BUNDLED_MODEL, load_tokenizer
from rollout_actors.wire import RendererConfig

IM_END = 151645
NEWLINE = 198
TOOLS = [
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}},
]
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    return load_tokenizer(BUNDLED_MODEL)


_renderers: dict[str, Renderer] = {}


def renderer(family: str = "qwen3", history: str = "append", **kwargs: Any) -> Renderer:
    key = RendererKey.from_config(
        BUNDLED_MODEL, RendererConfig(family=family, template_kwargs=kwargs, history=history)
    )
    if key.to_json() not in _renderers:
        _renderers[key.to_json()] = build_renderer(key)
    return _renderers[key.to_json()]


# ------------------------------------------------------------------------------------ strategies

_MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<|", "<tool_response>", "</tool_response>")


def _clean(text: str) -> bool:
    return unicodedata.normalize("NFC", text) == text and not any(m in text for m in _MARKERS)


texts = st.text(
    alphabet=st.sampled_from(list('abc xyz json JSON 012 \n\t{}[]":,.<>/é中🙂')), max_size=24
).filter(_clean)
json_values = st.one_of(st.integers(-5, 500), st.booleans(), st.none(), texts)
arguments = st.dictionaries(st.sampled_from(["q", "x", "query", "n"]), json_values, max_size=3)


@st.composite
def assistant_messages(draw: Any, reasoning: bool | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": draw(texts)}
    if reasoning is True or (reasoning is None and draw(st.booleans())):
        message["reasoning_content"] = draw(texts)
    calls = draw(st.lists(st.tuples(st.sampled_from(["search", "calc"]), arguments), max_size=2))
    if calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": name, "arguments": args}} for name, args in calls
        ]
    return message


@st.composite
def conversations(draw: Any) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(texts)})
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(texts)})
        for _ in range(draw(st.integers(0, 2))):
            reply = draw(assistant_messages())
            messages.append(reply)
            for _ in reply.get("tool_calls", []):
                messages.append({"role": "tool", "content": draw(texts)})
    return messages


def sampled_text(r: Renderer, message: dict[str, Any]) -> str:
    """What a model writes for `message` after the generation prompt, through its close token. (With
    thinking off the empty think block is prompt: give such messages `reasoning_content=""`.)"""
    user = [{"role": "user", "content": "u"}]
    prompt = r.render_text(user, None, True)
    full = r.render_text([*user, message], None, False)
    assert full.startswith(prompt)
    return full[len(prompt) :].removesuffix("\n")


def sampled_body(r: Renderer, message: dict[str, Any]) -> list[int]:
    """The completion ids a model would sample for `message`, tokenized canonically (on their own)."""
    return r.encode(sampled_text(r, message))


def split_ids(r: Renderer, text: str, cuts: list[int]) -> list[int]:
    """Tokenise `text` in pieces: a non-canonical (but valid) id sequence for the same text."""
    ids: list[int] = []
    last = 0
    for cut in sorted({c % (len(text) + 1) for c in cuts} | {len(text)}):
        ids += r.encode(text[last:cut])
        last = cut
    return ids


def full_ids(hf_tokenizer: Any, messages: list[dict[str, Any]], tools: Any, **kwargs: Any) -> list[int]:
    text = hf_tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
    )
    return hf_tokenizer.encode(text, add_special_tokens=False)


def bridge(
    r: Renderer,
    prompt: list[int],
    messages: list[dict[str, Any]],
    completion: list[int],
    new,
    tools=None,
    state=None,
    finish_reason=None,
):  # noqa: E501
    """Drive a renderer the way the session does (history only when asked)."""
    request = BridgeRequest(
        completion_ids=completion,
        finish_reason=finish_reason,
        new_messages=new,
        tools=tools,
        state=state or TrajectoryState(),
    )
    if r.always_needs_history:
        request.history = History(messages=messages, prompt_ids=prompt)
    reply = r.bridge(request)
    if reply.needs_history:
        request.history = History(messages=messages, prompt_ids=prompt)
        reply = r.bridge(request)
    assert not reply.needs_history
    next_prompt = reply.prompt_ids if reply.forked else prompt + completion + reply.appended_ids
    return next_prompt, reply


# ------------------------------------------------------------------------------------- rendering


@PROPERTY
@given(
    messages=conversations(),
    tools=st.sampled_from([None, TOOLS]),
    thinking=st.booleans(),
    drop=st.booleans(),
)
def test_native_render_agrees_with_the_jinja_template(hf_tokenizer, messages, tools, thinking, drop):
    kwargs = {"enable_thinking": thinking, "drop_past_reasoning": drop}
    rendered = renderer(**kwargs).render(messages, tools, True)
    assert rendered.ids == full_ids(hf_tokenizer, messages, tools, **kwargs)
    assert len(rendered.message_index) == len(rendered.sampled) == len(rendered.ids)


def test_render_attributes_tokens_to_messages_and_marks_sampled_bodies():
    for family in ("qwen3", "hf"):
        r = renderer(family)
        messages = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "reasoning_content": "greet"},
        ]
        out = r.render(messages, None, True)
        sampled_text = r.decode([t for t, s in zip(out.ids, out.sampled, strict=True) if s])
        assert sampled_text == "<think>\ngreet\n</think>\n\nhello<|im_end|>", family
        assert out.message_index[0] == 0 and out.message_index[-1] == SCAFFOLD
        assert r.decode([t for t, m in zip(out.ids, out.message_index, strict=True) if m == 1]) == (
            "<|im_start|>user\nhi<|im_end|>\n"
        )


# ---------------------------------------------------------------------------------------- bridge


@PROPERTY
@given(
    start=conversations(),
    turns=st.lists(
        st.tuples(assistant_messages(), st.lists(st.integers(0, 200), max_size=4), st.booleans()),
        min_size=1,
        max_size=4,
    ),
    family=st.sampled_from(["qwen3", "hf"]),
    drop=st.booleans(),
)
def test_bridge_always_extends_previous_prompt_and_completion(start, turns, family, drop):
    """Whatever was sampled (canonical or not, cut by length or not), under `append` the next prompt
    starts with exactly previous prompt + completion: no sampled id is ever re-tokenized."""
    r = renderer(family, "append", drop_past_reasoning=drop)
    if start[-1]["role"] == "assistant":
        start = [*start, {"role": "user", "content": "go on"}]
    prompt = r.start(start, TOOLS).prompt_ids
    messages, state = list(start), TrajectoryState()
    for message, cuts, cut_by_length in turns:
        text = r.decode(sampled_body(r, message))
        completion = split_ids(r, text, cuts)
        if cut_by_length:
            completion = completion[: max(1, len(completion) // 2)]
        new = (
            [{"role": "tool", "content": "result"}]
            if message.get("tool_calls")
            else [{"role": "user", "content": "next"}]
        )
        next_prompt, reply = bridge(r, prompt, messages, completion, new, TOOLS, state)
        assert not reply.forked
        assert next_prompt[: len(prompt) + len(completion)] == prompt + completion
        assert reply.synthetic_close == (completion[-1] != IM_END)
        if reply.synthetic_close:
            assert next_prompt[len(prompt) + len(completion)] == IM_END
        messages += [reply.assistant_message, *new]
        prompt, state = next_prompt, reply.state


@PROPERTY
@given(
    start=conversations(),
    replies=st.lists(assistant_messages(), min_size=1, max_size=3),
    family=st.sampled_from(["qwen3", "hf"]),
    thinking=st.booleans(),
)
def test_canonical_bridge_equals_full_render_within_a_tool_cycle(
    hf_tokenizer, start, replies, family, thinking
):
    kwargs = {"enable_thinking": thinking}
    r = renderer(family, **kwargs)
    if start[-1]["role"] == "assistant":
        start = [*start, {"role": "user", "content": "go on"}]
    prompt = r.start(start, TOOLS).prompt_ids
    assert prompt == full_ids(hf_tokenizer, start, TOOLS, **kwargs)
    messages, state = list(start), TrajectoryState()
    for message in replies:
        if not thinking:
            message = {**message, "reasoning_content": ""}
        # A body that starts with whitespace merges with the role header's newline in a full render: no
        # sampling could equal that tokenization, so it is outside this property.
        assume(not sampled_text(r, message)[:1].isspace())
        completion = sampled_body(r, message)
        new = [
            {"role": "tool", "content": f"result {i}"} for i, _ in enumerate(message.get("tool_calls", []))
        ]
        prompt, reply = bridge(r, prompt, messages, completion, new, TOOLS, state)
        messages += [reply.assistant_message, *new]
        state = reply.state
        assert prompt == full_ids(hf_tokenizer, messages, TOOLS, **kwargs)


@pytest.mark.parametrize("family", ["qwen3", "hf"])
def test_non_canonical_sampled_ids_survive_every_later_turn(family):
    r = renderer(family)
    assert r.encode("json") != r.encode("js") + r.encode("on")
    prompt = r.start([{"role": "user", "content": "format?"}], TOOLS).prompt_ids
    sampled = r.encode("I like ") + r.encode("js") + r.encode("on") + [IM_END]
    position = len(prompt)
    messages = [{"role": "user", "content": "format?"}]
    for turn in range(4):
        new = [{"role": "user", "content": f"turn {turn}: json again?"}]
        completion = sampled if turn == 0 else r.encode("json, canonically") + [IM_END]
        prompt, reply = bridge(r, prompt, messages, completion, new, TOOLS)
        messages += [reply.assistant_message, *new]
        assert prompt[position : position + len(sampled)] == sampled, f"turn {turn} altered sampled ids"
    assert messages[1]["content"] == "I like json"


def test_length_cut_turn_is_closed_with_a_synthetic_close_then_the_newline():
    r = renderer()
    prompt = r.start([{"role": "user", "content": "count"}], None).prompt_ids
    completion = r.encode("<think>\n1 2 3")  # cut by length inside the reasoning
    nxt, reply = bridge(
        r, prompt, [], completion, [{"role": "user", "content": "go"}], finish_reason="length"
    )
    assert reply.synthetic_close
    tail = nxt[len(prompt) + len(completion) :]
    assert tail[:2] == [IM_END, NEWLINE]
    assert r.decode(tail) == "<|im_end|>\n<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n"
    closed = completion + [IM_END]
    nxt2, reply2 = bridge(r, prompt, [], closed, [{"role": "user", "content": "go"}])
    assert not reply2.synthetic_close and nxt2 == nxt


@pytest.mark.parametrize("family", ["qwen3", "hf"])
def test_assistant_messages_in_new_messages_are_refused(family):
    r = renderer(family)
    prompt = r.start([{"role": "user", "content": "q"}], None).prompt_ids
    with pytest.raises(ValueError, match="assistant"):
        bridge(r, prompt, [], [IM_END], [{"role": "assistant", "content": "rewritten"}])


@pytest.mark.parametrize("family", ["qwen3", "hf"])
def test_rewriting_template_forks_explicitly_and_never_alters_tokens(hf_tokenizer, family):
    """`drop_past_reasoning` rewrites earlier turns when a user message arrives: under
    `fork_on_rewrite` the trajectory forks (marked, full re-render); under `append` it keeps appending."""
    kwargs = {"drop_past_reasoning": True}
    start = [{"role": "user", "content": "2+2?"}]
    answer = {"role": "assistant", "content": "4", "reasoning_content": "two and two"}
    for policy in ("fork_on_rewrite", "append"):
        r = renderer(family, policy, **kwargs)
        prompt = r.start(start, None).prompt_ids
        completion = sampled_body(r, answer)
        new = [{"role": "user", "content": "and 3+3?"}]
        nxt, reply = bridge(r, prompt, list(start), completion, new)
        rerender = full_ids(hf_tokenizer, [*start, answer, *new], None, **kwargs)
        if policy == "fork_on_rewrite":
            assert reply.forked and nxt == rerender
            assert r.decode(completion) not in r.decode(nxt)  # the reasoning really was dropped
        else:
            assert not reply.forked and nxt != rerender
            assert nxt[: len(prompt) + len(completion)] == prompt + completion


def test_tool_results_without_a_user_message_do_not_fork_a_rewriting_template():
    r = renderer("qwen3", "fork_on_rewrite", drop_past_reasoning=True)
    prompt = r.start([{"role": "user", "content": "q"}], TOOLS).prompt_ids
    call = {
        "role": "assistant",
        "content": "",
        "reasoning_content": "look it up",
        "tool_calls": [{"function": {"name": "search", "arguments": {"q": "x"}}}],
    }
    nxt, reply = bridge(r, prompt, [], sampled_body(r, call), [{"role": "tool", "content": "found"}], TOOLS)
    assert not reply.forked and reply.state.reasoning_pending


# ------------------------------------------------------------------------------------------ parse


@PROPERTY
@given(message=assistant_messages(), family=st.sampled_from(["qwen3", "hf"]))
def test_parse_round_trips_a_rendered_assistant_message(message, family):
    r = renderer(family)
    parsed = r.parse(sampled_body(r, message), TOOLS)
    assert parsed.closed
    assert parsed.content == (message["content"] or None)
    assert parsed.reasoning == message.get("reasoning_content")
    calls = message.get("tool_calls", [])
    assert [c.name for c in parsed.tool_calls] == [c["function"]["name"] for c in calls]
    assert all(c.status == "ok" for c in parsed.tool_calls)
    assert [c.arguments for c in parsed.tool_calls] == [c["function"]["arguments"] for c in calls]
    sent = parsed.message.get("tool_calls", [])
    assert [json.loads(c["function"]["arguments"]) for c in sent] == [
        c["function"]["arguments"] for c in calls
    ]
    # The parsed message re-renders to the very ids that were sampled.
    assert sampled_body(r, parsed.message) == sampled_body(r, message)


def test_parse_reports_each_tool_call_status():
    r = renderer()

    def call(body: str, close: bool = True) -> str:
        return "<tool_call>\n" + body + ("\n</tool_call>" if close else "")

    text = "\n".join(
        [
            "checking",
            call('{"name": "search", "arguments": {"q": "a"}}'),
            call('{"name": "search", "arguments": {"q": '),
            call('{"arguments": {"q": "a"}}'),
            call('{"name": "launch", "arguments": {}}'),
            call('{"name": "calc", "arguments": {"n": 1}}', close=False),
        ]
    )
    parsed = r.parse(r.encode(text), TOOLS)
    assert [c.status for c in parsed.tool_calls] == [
        "ok",
        "invalid_json",
        "missing_name",
        "unknown_tool",
        "unclosed",
    ]
    assert parsed.content == "checking" and not parsed.closed
    assert [c["function"]["name"] for c in parsed.message["tool_calls"]] == ["search", "launch"]


def test_parse_finds_markers_by_id_not_by_text():
    """The text "<tool_call>" spelled with ordinary ids is content, not a call."""
    r = renderer()
    spelled = r.encode("see <tool") + r.encode("_call> here")
    assert 151657 not in spelled
    parsed = r.parse(spelled + [IM_END], TOOLS)
    assert parsed.tool_calls == [] and parsed.content == "see <tool_call> here"


def test_parse_reasoning_cut_by_length_has_no_content():
    r = renderer()
    parsed = r.parse(r.encode("<think>\nstill thinking"), None)
    assert parsed.reasoning == "still thinking" and parsed.content is None and not parsed.closed


# ------------------------------------------------------------------------------ another template

GENERIC_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|endoftext|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_generic_family_serves_any_chat_template(tmp_path, hf_tokenizer):
    """A template with another close token (`<|endoftext|>`) and no boundary newline: `auto` picks the
    generic family, which learns the close from a synthetic render and bridges exactly."""
    hf_tokenizer.save_pretrained(str(tmp_path))
    (tmp_path / "chat_template.jinja").write_text(GENERIC_TEMPLATE)
    for name in ("tokenizer_config.json",):
        config = json.loads((tmp_path / name).read_text())
        config.pop("chat_template", None)
        (tmp_path / name).write_text(json.dumps(config))
    r = build_renderer(RendererKey.from_config(str(tmp_path), RendererConfig()))
    assert r.family == "hf" and r.close_id == 151643 and r.boundary == ""
    other = load_tokenizer(str(tmp_path))
    start = [{"role": "user", "content": "hi"}]
    prompt = r.start(start, None).prompt_ids
    completion = r.encode("hello there") + [151643]
    nxt, reply = bridge(r, prompt, start, completion, [{"role": "user", "content": "bye"}])
    expected = other.apply_chat_template(
        [*start, {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "bye"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert nxt == other.encode(expected, add_special_tokens=False)
    assert reply.assistant_message["content"] == "hello there"
