"""The model's own chat template is the reference (issue #25), property-tested with hypothesis.

For the templates at hand offline (the bundled model's, with its kwargs; the same template and a variant
that closes assistant turns with another token, served through the `default` family), over conversations
with reasoning (none, empty, text), tool calls with compact, spaced, escaped and nested JSON arguments,
several calls per turn, empty turns and unicode, thinking on and off:

1. the first render equals `apply_chat_template` on the same messages, tools and kwargs, token for token;
2. a bridge forks exactly when the template's render of the longer conversation does not begin with the
   trajectory (previous prompt + the sampled turn), and an unforked prompt is the template's render;
3. parse is the inverse of render: a completion the template renders parses back to a message that
   renders to the same ids (reasoning, content and argument text as written), a length cut inside the
   reasoning keeps no marker newline, and the turn's close is one of the renderer's stop ids.

Qwen3 with thinking off (the library's deliberate deviation) is checked against what Qwen3's template
does with history, and the switch that keeps the deviation.
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

import pytest
from family_tokenizers import reference_template, template_variant, trl_template
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from renderer_actors.calls import BridgeRequest, History
from renderer_actors.config import RendererConfig
from renderer_actors.key import RendererKey
from renderer_actors.renderer import Renderer
from renderer_actors.tokenizer import BUNDLED_MODEL, chat_template_text, load_tokenizer

TOOLS = [
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "lookup_2", "parameters": {"type": "object"}}},
]
ASSISTANT_CLOSE = "{{- '<|im_end|>\\n' -}}\n    {%- elif m.role == 'tool' -%}"
ENDOFTEXT_CLOSED = chat_template_text().replace(
    ASSISTANT_CLOSE, ASSISTANT_CLOSE.replace("<|im_end|>", "<|endoftext|>")
)
"""The bundled template, closing assistant turns with `<|endoftext|>` (not the tokenizer's eos)."""
assert ENDOFTEXT_CLOSED != chat_template_text()
QWEN3_APRIL = template_variant("qwen3-april", reference_template("Qwen--Qwen3.2025-04-original"))
"""Qwen3 as released (April 2025): a tool-call turn needs `content` to be a string (`''`, not None)."""

# (model, renderer config): every template this module holds renderers to.
CASES = {
    "bundled": lambda: (BUNDLED_MODEL, {}),
    "bundled-thinking-off": lambda: (BUNDLED_MODEL, {"template_kwargs": {"enable_thinking": False}}),
    "bundled-drop-past": lambda: (BUNDLED_MODEL, {"template_kwargs": {"drop_past_reasoning": True}}),
    "default": lambda: (BUNDLED_MODEL, {"family": "default", "options": {"tool_parser": "qwen3"}}),
    "default-thinking-off": lambda: (
        BUNDLED_MODEL,
        {
            "family": "default",
            "options": {"tool_parser": "qwen3"},
            "template_kwargs": {"enable_thinking": False},
        },
    ),
    "default-other-close": lambda: (
        template_variant("endoftext-closed", ENDOFTEXT_CLOSED),
        {"family": "default", "options": {"tool_parser": "qwen3"}},
    ),
    # Qwen3's own templates on Qwen's real vocabulary (the bundled tokenizer's ranks and specials).
    "qwen3": lambda: (template_variant("qwen3-8b", trl_template("qwen3")), {"family": "qwen3"}),
    "qwen3-thinking-off": lambda: (
        template_variant("qwen3-8b", trl_template("qwen3")),
        {"family": "qwen3", "template_kwargs": {"enable_thinking": False}},
    ),
    "qwen3-april-2025": lambda: (QWEN3_APRIL, {"family": "qwen3"}),
    "default-qwen3-april-2025": lambda: (
        QWEN3_APRIL,
        {"family": "default", "options": {"tool_parser": "qwen3"}},
    ),
}
UNPARSED = {"qwen3", "qwen3-thinking-off", "qwen3-april-2025", "default-qwen3-april-2025"}
"""Qwen3's own templates render an empty think block on the last turn where the turn has no reasoning
(the parse then reads `""`, not None): the parse property, written for the bundled template's shape, is
not yet adapted to them (docs/renderers.md)."""
PARSED = [name for name in CASES if name not in UNPARSED]
BRIDGED = [name for name in CASES if name not in {"qwen3", "qwen3-april-2025", "default-qwen3-april-2025"}]
"""Not yet adapted to the bridge property's reference (the turn as generated, not as parsed): Qwen3-8B
with thinking on (hypothesis finds whitespace-only reasoning, which the parse reads as another
reasoning than the one generated, and a turn after a fork, whose generation prompt the reference does
not extend), and the April-2025 template (it renders a past turn's reasoning differently for None and
`""`). Their explicit tests below hold the behaviour that matters (docs/renderers.md)."""
SPLITS_CONTENT = {"qwen3", "qwen3-thinking-off", "qwen3-april-2025"}
"""Where the library encodes a past assistant turn's content apart from its role line (as a model samples
it, after the generation prompt's newline), so content that starts with whitespace does not merge with
that newline as the template's one-pass encode does: the same text, other ids (docs/renderers.md)."""
_LOADED: dict[str, tuple[Renderer, Any, dict[str, Any]]] = {}


def case(name: str) -> tuple[Renderer, Any, dict[str, Any]]:
    """(renderer, the Hugging Face tokenizer holding the template, the template kwargs)."""
    if name not in _LOADED:
        model, config = CASES[name]()
        r = Renderer.load(RendererKey.from_config(model, RendererConfig(**config)))
        _LOADED[name] = (r, load_tokenizer(model), dict(config.get("template_kwargs", {})))
    return _LOADED[name]


def template(hf: Any, kwargs: dict[str, Any], messages, tools, add_generation_prompt: bool) -> list[int]:
    """The reference: the template's own render, tokenised by Hugging Face, of the messages as vLLM hands
    them over (an assistant's `reasoning` under both names)."""
    handed = [
        {**m, "reasoning_content": m["reasoning"]} if m.get("reasoning") is not None else m for m in messages
    ]
    ids = hf.apply_chat_template(
        handed,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
        **kwargs,
    )
    return list(ids)


WORDS = [
    "the",
    " word",
    "json",
    "café",
    "cafe\u0301",
    "東京",
    "🙂",
    " ",
    "\n",
    "\n\n",
    "{",
    "}",
    '"',
    "\\",
    "42",
    "é",
]
TEXT = st.lists(st.sampled_from(WORDS), max_size=8).map("".join)
NONEMPTY = TEXT.filter(lambda s: s.strip() != "")
VALUE = st.recursive(
    st.one_of(st.integers(-5, 500), st.booleans(), st.none(), TEXT),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["q", "n", "é", "k y"]), inner, max_size=3),
    ),
    max_leaves=6,
)
ARGUMENTS = st.tuples(
    st.dictionaries(st.sampled_from(["q", "n", "city", "ü"]), VALUE, max_size=3),
    st.sampled_from(["spaced", "compact", "escaped", "indented"]),
).map(
    lambda a: {
        "spaced": json.dumps(a[0], ensure_ascii=False),
        "compact": json.dumps(a[0], ensure_ascii=False, separators=(",", ":")),
        "escaped": json.dumps(a[0]),
        "indented": json.dumps(a[0], ensure_ascii=False, separators=(", ", ":  ")),
    }[a[1]]
)
CALL = st.tuples(st.sampled_from(["search", "lookup_2"]), ARGUMENTS)
ASSISTANT = st.tuples(st.one_of(st.none(), st.just(""), TEXT), TEXT, st.lists(CALL, max_size=3))
"""(reasoning, content, calls)."""


def assistant(reasoning, content, calls, thinking: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if not thinking:
        reasoning = ""  # the generation prompt prefilled an empty think block: the turn's reasoning
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
            for i, (name, arguments) in enumerate(calls)
        ]
    return message


def replies(message: dict[str, Any], user: str) -> list[dict[str, Any]]:
    calls = message.get("tool_calls") or []
    if calls:
        return [{"role": "tool", "content": f"result {i} {user}"} for i in range(len(calls))]
    return [{"role": "user", "content": user}]


def sampled_turn(r: Renderer, prompt: list[int], full: list[int]) -> tuple[list[int], bool]:
    """The completion a model samples for the last assistant turn of `full`: after the prompt, through
    the template's turn close (the next prompt's newline is the template's, not sampled); and whether
    the template's ids split there (else a body starting with whitespace merged with the prompt's last
    newline: a model samples the same text after the prompt's own token, so it is compared as text)."""
    close = max(i for i, token in enumerate(full) if token in r.stop_ids)
    if full[: len(prompt)] == prompt:
        assert close >= len(prompt), "the assistant turn has no stop id of the renderer"
        return full[len(prompt) : close + 1], True
    text, head = r.decode(full[:close]), r.decode(prompt)
    assert text.startswith(head), "the template's assistant turn does not extend its generation prompt"
    return r.encode(text[len(head) :]) + [full[close]], False


def same(r: Renderer, a: list[int], b: list[int], by_ids: bool) -> bool:
    if by_ids:
        return a == b
    return r.tokenizer.normalize(r.decode(a)) == r.tokenizer.normalize(r.decode(b))


def nfc(text: str | None) -> str | None:
    return None if text is None else unicodedata.normalize("NFC", text)


PROFILE = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", list(CASES))
@PROFILE
@given(
    system=st.one_of(st.none(), TEXT),
    first=TEXT,
    history=st.lists(st.tuples(ASSISTANT, NONEMPTY), max_size=3),
    tools=st.booleans(),
)
def test_the_first_render_is_the_templates(name, system, first, history, tools):
    r, hf, kwargs = case(name)
    thinking = kwargs.get("enable_thinking", True)
    messages: list[dict[str, Any]] = (
        [{"role": "system", "content": system}] if system is not None else []
    ) + [{"role": "user", "content": first}]
    for (reasoning, content, calls), user in history:
        message = assistant(reasoning, content, calls, thinking)
        messages += [message, *replies(message, user)]
    use = TOOLS if tools else None
    for ours, theirs in [
        (r.start(messages, use).prompt_ids, template(hf, kwargs, messages, use, True)),
        (r.render_ids(messages, use, False), template(hf, kwargs, messages, use, False)),
    ]:
        if name in SPLITS_CONTENT and any(
            m["role"] == "assistant" and (m["content"] or "x")[:1].isspace() for m in messages
        ):
            # the known deviation: the same text, the turn's content encoded apart from its role line
            assert r.decode(ours) == hf.decode(theirs)
        else:
            assert ours == theirs


@pytest.mark.parametrize("name", BRIDGED)
@PROFILE
@given(first=NONEMPTY, turns=st.lists(st.tuples(ASSISTANT, NONEMPTY, st.booleans()), min_size=1, max_size=3))
def test_a_bridge_forks_exactly_when_the_template_rewrites(name, first, turns):
    r, hf, kwargs = case(name)
    thinking = kwargs.get("enable_thinking", True)
    messages: list[dict[str, Any]] = [{"role": "user", "content": first}]
    prompt = r.start(messages, TOOLS).prompt_ids
    tail = list(prompt)
    by_ids = True  # no sampled turn so far merged with its prompt's last token
    for (reasoning, content, calls), user, new_user in turns:
        if name in SPLITS_CONTENT:
            content = content.strip()  # the library's Qwen3 parse strips it (test_qwen3_deviation_...)
        message = assistant(reasoning, content, calls, thinking)
        completion, split = sampled_turn(r, prompt, template(hf, kwargs, [*messages, message], TOOLS, False))
        by_ids = by_ids and split
        new = [{"role": "user", "content": user}] if new_user else replies(message, user)
        request = BridgeRequest(completion_ids=completion, new_messages=new, tools=TOOLS, prompt_tail=tail)
        reply = r.bridge(request)
        if reply.needs_history:
            request.history = History(messages=messages, prompt_ids=prompt)
            reply = r.bridge(request)
        assert not reply.synthetic_close
        # The reference holds the turn as the model wrote it; the trajectory's history, as parsed.
        reference = template(hf, kwargs, [*messages, message, *new], TOOLS, True)
        messages = [*messages, reply.assistant_message, *new]
        before = prompt + completion
        text = r.tokenizer.normalize(r.decode(reference))
        rewrites = not text.startswith(r.tokenizer.normalize(r.decode(before)))
        assert reply.forked == rewrites, reply.fork_reason
        if reply.forked:
            prompt, tail, by_ids = list(reply.prompt_ids), list(reply.prompt_ids), True
        else:
            prompt, tail = before + reply.appended_ids, list(reply.appended_ids)
        # The sampled turn, re-rendered from its parse, is what was sampled: the prompt is the template's.
        assert same(r, prompt, reference, by_ids)


@pytest.mark.parametrize("name", PARSED)
@PROFILE
@given(first=NONEMPTY, turn=ASSISTANT, cut=st.integers(1, 6))
def test_parse_is_the_inverse_of_the_templates_render(name, first, turn, cut):
    r, hf, kwargs = case(name)
    thinking = kwargs.get("enable_thinking", True)
    messages: list[dict[str, Any]] = [{"role": "user", "content": first}]
    prompt = r.start(messages, TOOLS).prompt_ids
    message = assistant(*turn, thinking)
    completion, _ = sampled_turn(r, prompt, template(hf, kwargs, [*messages, message], TOOLS, False))
    parsed = r.parse(completion, TOOLS, prompt)
    assert parsed.closed
    assert r.render_ids([*messages, parsed.message], TOOLS, False) == template(
        hf, kwargs, [*messages, message], TOOLS, False
    )
    assert nfc(parsed.reasoning) == nfc(message.get("reasoning_content"))
    assert nfc(parsed.content or "") == nfc(message["content"])
    sampled = [c["function"] for c in message.get("tool_calls", [])]
    got = [c["function"] for c in parsed.message.get("tool_calls", [])]
    assert [(f["name"], nfc(f["arguments"])) for f in got] == [
        (f["name"], nfc(f["arguments"])) for f in sampled
    ]

    reasoning = message.get("reasoning_content")
    # a length stop inside the reasoning; reasoning that opens with whitespace merges with the "\n" after
    # `<think>` into one BPE token, so the opening is not a token prefix there
    if thinking and reasoning and not reasoning[:1].isspace():
        opened = r.encode("<think>\n")
        assert completion[: len(opened)] == opened
        head = r.encode(reasoning)[:cut]
        parsed = r.parse(opened + head, TOOLS, prompt)
        assert not parsed.closed and parsed.content is None
        assert nfc(parsed.reasoning) == nfc(r.decode(head))


def test_the_templates_own_close_is_a_stop_id_and_closes_a_cut_turn():
    r, hf, _ = case("default-other-close")
    endoftext = r.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert endoftext in r.stop_ids and hf.eos_token_id != endoftext
    messages = [{"role": "user", "content": "hi"}]
    prompt = r.start(messages, None).prompt_ids
    parsed = r.parse(r.encode("hello") + [endoftext], None, prompt)
    assert parsed.closed and parsed.content == "hello"
    cut = r.bridge(
        BridgeRequest(
            completion_ids=r.encode("hel"),
            new_messages=[{"role": "user", "content": "go on"}],
            prompt_tail=prompt,
            history=History(messages=messages, prompt_ids=prompt),
        )
    )
    assert cut.synthetic_close and not cut.forked
    assert r.decode(cut.appended_ids[: cut.synthetic_ids]) == "<|endoftext|>"


def test_an_empty_think_block_is_an_empty_reasoning_and_a_cut_one_loses_its_marker_newline():
    for family in ("bundled", "qwen3"):
        r = Renderer.load(RendererKey.from_config(BUNDLED_MODEL, RendererConfig(family=family)))
        prompt = r.start([{"role": "user", "content": "hi"}], None).prompt_ids
        im_end = r.tokenizer.convert_tokens_to_ids("<|im_end|>")
        empty = r.parse(r.encode("<think>\n\n</think>\n\nhello") + [im_end], None, prompt)
        assert empty.reasoning == "" and empty.content == "hello", family
        cut = r.parse(r.encode("<think>\nstill thinking"), None, prompt)
        assert cut.reasoning == "still thinking" and not cut.closed, family


def test_the_bundled_model_keeps_past_reasoning_across_user_turns_as_its_template_does():
    r, hf, kwargs = case("bundled")
    assert r.family == "bundled"
    messages = [{"role": "user", "content": "hi"}]
    prompt = r.start(messages, None).prompt_ids
    completion = r.encode("<think>\nhmm\n</think>\n\nhello") + [
        r.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ]
    reply = r.bridge(
        BridgeRequest(
            completion_ids=completion, new_messages=[{"role": "user", "content": "again"}], prompt_tail=prompt
        )
    )
    assert not reply.needs_history and not reply.forked
    messages += [reply.assistant_message, {"role": "user", "content": "again"}]
    assert prompt + completion + reply.appended_ids == template(hf, kwargs, messages, None, True)


def test_a_template_that_refuses_none_content_gets_a_string_for_a_turn_without_text():
    """Qwen3's April-2025 template tests `'</think>' in content`: a tool-call turn parsed without text
    (content None) is rendered with `''`, as the template takes it, not refused."""
    r, hf, kwargs = case("default-qwen3-april-2025")
    messages = [{"role": "user", "content": "find it"}]
    prompt = r.start(messages, TOOLS).prompt_ids
    call = {
        "role": "assistant",
        "content": "",
        "reasoning_content": "looking",
        "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}
        ],
    }
    completion, _ = sampled_turn(r, prompt, template(hf, kwargs, [*messages, call], TOOLS, False))
    answer = [{"role": "tool", "content": "found"}]
    reply = r.bridge(
        BridgeRequest(
            completion_ids=completion,
            new_messages=answer,
            tools=TOOLS,
            prompt_tail=prompt,
            history=History(messages=messages, prompt_ids=prompt),
        )
    )
    assert reply.assistant_message["content"] is None and not reply.forked
    assert prompt + completion + reply.appended_ids == template(
        hf, kwargs, [*messages, call, *answer], TOOLS, True
    )
    silent = [*messages, {"role": "assistant", "content": None}, {"role": "user", "content": "and?"}]
    as_taken = [*messages, {"role": "assistant", "content": ""}, {"role": "user", "content": "and?"}]
    assert r.render_ids(silent, None, True) == template(hf, kwargs, as_taken, None, True)


def test_qwen3_deviation_the_librarys_parse_strips_content_and_an_empty_think_block_forks():
    """Against Qwen3-8B's own template: the library's Qwen3 parse strips a turn's content (" word" ->
    "word"), which the template writes as is, so such a turn re-renders otherwise (where history is
    re-rendered: a fork, never a swap); and an empty think block sampled on a call turn, which the
    template drops once the turn is not the last, is checked against the full render and forks
    (the library's bridge would have kept it: `renderer.EMPTY_THINK_DROPPED`)."""
    r, hf, kwargs = case("qwen3")
    messages = [{"role": "user", "content": "the"}]
    prompt = r.start(messages, TOOLS).prompt_ids
    im_end = r.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert r.parse(r.encode("<think>\nhm\n</think>\n\n word") + [im_end], TOOLS, prompt).content == "word"
    call = r.encode('<think>\n\n</think>\n\n<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>')
    request = BridgeRequest(
        completion_ids=call + [im_end],
        new_messages=[{"role": "tool", "content": "found"}],
        tools=TOOLS,
        prompt_tail=prompt,
    )
    assert r.bridge(request).needs_history
    request.history = History(messages=messages, prompt_ids=prompt)
    reply = r.bridge(request)
    assert reply.forked and "<think>" not in r.decode(reply.prompt_ids[len(prompt) :])


# ------------------------------------------------------------------- qwen3, thinking off (a deviation)


def qwen3_off(family: str = "qwen3", **config: Any) -> Renderer:
    off = RendererConfig(family=family, template_kwargs={"enable_thinking": False}, **config)
    return Renderer.load(RendererKey.from_config(BUNDLED_MODEL, off))


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5", "qwen3.6"])
def test_qwen3_thinking_off_renders_history_as_the_template_and_forks_where_it_rewrites(family):
    """Qwen3's template (and, as the library documents its deviation, Qwen3.5's and 3.6's) renders past
    turns the same whatever `enable_thinking` is (it drops the empty think block the generation prompt
    prefilled); only its generation prompt differs."""
    r = qwen3_off(family)
    on = Renderer.load(
        RendererKey.from_config(
            BUNDLED_MODEL, RendererConfig(family=family, template_kwargs={"enable_thinking": True})
        )
    )
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
    ]
    first = r.start(history, TOOLS).prompt_ids
    assert first == on.render_ids(history, TOOLS, False) + r.encode(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert r.decode(first).count("<think>") == 1  # the generation prompt's, none on the past turn

    completion = r.encode("fine") + [r.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    request = BridgeRequest(
        completion_ids=completion, new_messages=[{"role": "user", "content": "again"}], prompt_tail=first
    )
    assert r.bridge(request).needs_history
    request.history = History(messages=history, prompt_ids=first)
    reply = r.bridge(request)
    assert reply.forked and "template rewrites past turns" in reply.fork_reason
    assert reply.prompt_ids == r.render_ids(
        [*history, reply.assistant_message, *request.new_messages], None, True
    )


@pytest.mark.parametrize(
    ("family", "faithful"), [("qwen3", False), ("qwen3.5", False), ("qwen3.6", False), ("qwen3.8", True)]
)
def test_qwen3_thinking_off_keeps_the_librarys_stable_history_when_switched_to(family, faithful):
    """`template_faithful=False`, and Qwen3.8 always: its `enable_thinking` also changes the system
    prompt, so history cannot be rendered as with thinking on (the library's deviation stays)."""
    r = qwen3_off(family, template_faithful=faithful)
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
    ]
    first = r.start(history, None).prompt_ids
    assert r.decode(first).count("<think>") == 2  # the deviation: re-emitted on the past turn
    completion = r.encode("fine") + [r.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    reply = r.bridge(
        BridgeRequest(
            completion_ids=completion, new_messages=[{"role": "user", "content": "again"}], prompt_tail=first
        )
    )
    assert not reply.forked and not reply.needs_history
