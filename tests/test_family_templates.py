"""Every library family against its model's own chat template (issue #45), property-tested.

The templates are the models' own (`trl/chat_templates/` where the `trl` wheel ships the family, else
`tests/templates/` with a `.source.txt` each); the vocabularies are stand-ins carrying each family's
special tokens as single ids (`family_tokenizers.py`: the real ones cannot be had offline). For each
family, over conversations within what its template renders as the library does:

1. the first render is the template's (text and ids);
2. a bridge forks exactly when the template's re-render of the longer conversation does not begin with
   the trajectory (prompt + the sampled turn), and an unforked prompt is the template's render (text);
3. a sampled tool call parses back to a message in the shape the template takes (DeepSeek: arguments as
   a JSON string and `None` content; GLM: arguments as a mapping, `''` content) that renders the ids
   that were sampled;
4. a sample split into other tokens than the canonical encode bridges to the same text, fork for fork,
   and one cut by `length` is closed synthetically and kept as sampled.

Where the library departs from a template the departure is asserted exactly (`test_*_deviation*`), and
listed in the family table (docs/renderers.md). Qwen3's own templates are in `test_template_fidelity.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from family_tokenizers import reference_template, template_variant, trl_template
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from renderer_actors.calls import BridgeRequest, History
from renderer_actors.config import RendererConfig
from renderer_actors.key import RendererKey
from renderer_actors.renderer import Renderer
from renderer_actors.tokenizer import load_tokenizer


@dataclass(frozen=True)
class Family:
    """One family held to one template, and the part of conversation space where the two agree."""

    family: str
    template: str
    """`trl:<name>` or `ref:<file>`."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    mapping_arguments: bool = False
    """The template iterates / re-serialises a call's arguments: it takes them as a mapping."""
    calls: bool = True
    """Tool calls render as the library renders them (False: a known deviation, asserted apart)."""
    reasoning: bool = False
    """The template renders `reasoning_content` of turns after the last user message."""
    thinks_in_prompt: bool = False
    """The generation prompt opens the reasoning (`<think>\\n`): a sample starts inside it."""
    needs_system: bool = False
    """Without a system message the template's default system prompt is not the library's (deviation)."""
    one_call_turn: bool = False
    """The template renders a second tool-call turn of a conversation as a continuation of the first
    (its `ns.is_first` is never reset: deviation): conversations here hold one."""

    def text(self) -> str:
        kind, name = self.template.split(":", 1)
        return trl_template(name) if kind == "trl" else reference_template(name)


FAMILIES = {
    "deepseek-v3": Family("deepseek-v3", "ref:deepseek-ai--DeepSeek-V3", calls=False),
    "deepseek-r1": Family("deepseek-r1", "trl:deepseekv3", thinks_in_prompt=True, one_call_turn=True),
    "glm-4.5": Family("glm-4.5", "trl:glm4moe", mapping_arguments=True, reasoning=True),
    "glm-4.5-thinking-off": Family(
        "glm-4.5", "trl:glm4moe", {"enable_thinking": False}, mapping_arguments=True, reasoning=True
    ),
    "kimi-k2": Family("kimi-k2", "ref:moonshotai--Kimi-K2-Instruct", calls=False, needs_system=True),
    "llama-3.1": Family("llama-3", "trl:llama3_1", mapping_arguments=True),
    "llama-3.2": Family(
        "llama-3",
        "trl:llama3_2",
        {"date_string": "26 Jul 2024"},
        mapping_arguments=True,
    ),
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"q": {"type": "string"}, "n": {"type": "integer"}},
            },
        },
    }
]
_LOADED: dict[str, tuple[Renderer, Any]] = {}


def case(name: str) -> tuple[Family, Renderer, Any]:
    """(the family case, its renderer, the Hugging Face tokenizer holding the model's template)."""
    spec = FAMILIES[name]
    if name not in _LOADED:
        model = template_variant(name, spec.text(), family=spec.family)
        config = RendererConfig(family=spec.family, template_kwargs=spec.template_kwargs)
        _LOADED[name] = (Renderer.load(RendererKey.from_config(model, config)), load_tokenizer(model))
    return (spec, *_LOADED[name])


def shaped(spec: Family, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to the family's template: an assistant's `reasoning` under both
    names, arguments decoded where the template wants a mapping."""
    out = []
    for m in messages:
        if m.get("reasoning") is not None:
            m = {**m, "reasoning_content": m["reasoning"]}
        if spec.mapping_arguments and m.get("tool_calls"):
            calls = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def template_text(spec: Family, hf: Any, messages, tools, add_generation_prompt: bool) -> str:
    kwargs = {**spec.template_kwargs, "add_generation_prompt": add_generation_prompt}
    return hf.apply_chat_template(shaped(spec, messages), tools=tools, tokenize=False, **kwargs)


def template(spec: Family, hf: Any, messages, tools, add_generation_prompt: bool) -> list[int]:
    """The reference: the template's own render, tokenised by Hugging Face."""
    return hf.encode(
        template_text(spec, hf, messages, tools, add_generation_prompt), add_special_tokens=False
    )


WORDS = ["the", "word", "json", "café", "東京", "42", "{", "}", '"', "x y"]
TEXT = st.lists(st.sampled_from(WORDS), min_size=1, max_size=5).map(" ".join)
ARGUMENTS = st.fixed_dictionaries({}, optional={"q": TEXT, "n": st.integers(0, 99)})
"""As the tool declares them (GLM's XML arguments carry no types: the parse reads them by the schema)."""
TURN = st.tuples(TEXT, st.one_of(st.none(), TEXT), st.one_of(st.none(), ARGUMENTS), TEXT, st.booleans())
"""(content, reasoning, a call's arguments or none, the next user's or tool's text, a new user turn)."""


def assistant(spec: Family, content: str, reasoning: str | None, arguments: dict | None) -> dict[str, Any]:
    """An assistant turn in the OpenAI shape (arguments as a JSON string); a call turn has no text
    (the shape every family's template takes for calls: Llama's drops text beside a call)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    thinking = spec.template_kwargs.get("enable_thinking", True)
    if (spec.reasoning and thinking or spec.thinks_in_prompt) and reasoning is not None:
        message["reasoning_content"] = reasoning
    if spec.calls and arguments is not None:
        message["content"] = "" if spec.mapping_arguments else None
        message["tool_calls"] = [
            {
                "id": "c0",
                "type": "function",
                "function": {"name": "search", "arguments": arguments_text(spec, arguments)},
            }
        ]
    return message


def arguments_text(spec: Family, arguments: dict[str, Any]) -> str:
    """As the model samples them: escaped JSON where the template renders the string as given (the
    parse keeps it), JSON as `tojson` writes it where the template re-serialises a mapping."""
    return json.dumps(arguments, ensure_ascii=not spec.mapping_arguments)


def answers(message: dict[str, Any], text: str, new_user: bool) -> list[dict[str, Any]]:
    """A call is answered by its tool; a turn without one by the user."""
    if message.get("tool_calls"):
        return [{"role": "tool", "tool_call_id": "c0", "content": text}]
    return [{"role": "user", "content": text}]


def opening(spec: Family, system: str | None, first: str) -> list[dict[str, Any]]:
    system = system if system is not None or not spec.needs_system else "Be brief."
    return ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": first}
    ]


def sampled_turn(
    spec: Family, r: Renderer, hf: Any, messages, message, tools, prompt: list[int]
) -> list[int]:
    """What the model samples for an assistant turn: the template's render of it after the generation
    prompt (where the prompt opened the reasoning, the reasoning first: the template drops it), closed by
    the family's stop token when the template does not close it."""
    turn = template_text(spec, hf, [*messages, message], tools, False)
    if spec.thinks_in_prompt:
        body = turn[len(template_text(spec, hf, messages, tools, False)) :].removeprefix("<｜Assistant｜>")
        text = f"{message.get('reasoning_content') or ''}\n</think>\n\n{body}"
    else:
        head = r.decode(prompt)
        assert turn.startswith(head), "the template's assistant turn does not extend its generation prompt"
        text = turn[len(head) :]
    ids = r.encode(text)
    if ids and ids[-1] in r.stop_ids:
        return ids
    # GLM's turn ends where the next message's marker starts: the model samples that marker
    return ids + r.encode("<|observation|>" if "<tool_call>" in text else "<|user|>")


PROFILE = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", list(FAMILIES))
@PROFILE
@given(system=st.one_of(st.none(), TEXT), first=TEXT, history=st.lists(TURN, max_size=3), tools=st.booleans())
def test_the_first_render_is_the_templates(name, system, first, history, tools):
    spec, r, hf = case(name)
    messages = opening(spec, system, first)
    for content, reasoning, arguments, reply, new_user in history:
        if spec.one_call_turn and any(m.get("tool_calls") for m in messages):
            arguments = None
        message = assistant(spec, content, reasoning, arguments)
        messages += [message, *answers(message, reply, new_user)]
    use = TOOLS if tools and spec.calls else None
    expected = template(spec, hf, messages, use, True)
    if spec.thinks_in_prompt and messages[-1]["role"] == "tool":
        expected += r.encode("<think>\n")  # the known deviation (test_deepseek_r1_deviation_...)
    assert r.decode(r.start(messages, use).prompt_ids) == hf.decode(expected)
    assert r.start(messages, use).prompt_ids == expected


@pytest.mark.parametrize("name", list(FAMILIES))
@PROFILE
@given(first=TEXT, turns=st.lists(TURN, min_size=1, max_size=3))
def test_a_bridge_forks_exactly_when_the_template_rewrites(name, first, turns):
    spec, r, hf = case(name)
    use = TOOLS if spec.calls else None
    messages = opening(spec, None, first)
    prompt = r.start(messages, use).prompt_ids
    tail = list(prompt)
    for content, reasoning, arguments, text, new_user in turns:
        if spec.one_call_turn and any(m.get("tool_calls") for m in messages):
            arguments = None
        message = assistant(spec, content, reasoning, arguments)
        completion = sampled_turn(spec, r, hf, messages, message, use, prompt)
        new = answers(message, text, new_user)
        request = BridgeRequest(completion_ids=completion, new_messages=new, tools=use, prompt_tail=tail)
        reply = r.bridge(request)
        if reply.needs_history:
            request.history = History(messages=messages, prompt_ids=prompt)
            reply = r.bridge(request)
        assert not reply.synthetic_close
        # the reference holds the turn as the template takes it; the trajectory's history, as parsed
        reference = template(spec, hf, [*messages, message, *new], use, True)
        if spec.thinks_in_prompt and new[-1]["role"] == "tool":
            reference += r.encode("<think>\n")  # the known deviation (test_deepseek_r1_deviation_...)
        messages = [*messages, reply.assistant_message, *new]
        before = prompt + completion
        normalize = r.tokenizer.normalize
        rewrites = not normalize(r.decode(reference)).startswith(normalize(r.decode(before)))
        assert reply.forked == rewrites, reply.fork_reason
        if reply.forked:
            prompt = tail = list(reply.prompt_ids)
        else:
            prompt, tail = before + reply.appended_ids, list(reply.appended_ids)
        assert normalize(r.decode(prompt)) == normalize(r.decode(reference))


# ------------------------------------------------------------------ tool calls, as each template takes them

CALL_TURNS = {
    # family case -> (what the model samples for one call, the parsed message's content)
    "deepseek-v3": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n"
        '{"q": "caf\\u00e9",  "n": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
        None,
    ),
    "deepseek-r1": (
        "hm\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n"
        '{"q": "caf\\u00e9",  "n": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
        None,
    ),
    "glm-4.5": (
        "\n<think>hm</think>\n<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>café</arg_value>\n"
        "<arg_key>n</arg_key>\n<arg_value>1</arg_value>\n</tool_call><|observation|>",
        "",
    ),
    "llama-3.1": ('{"name": "search", "parameters": {"q": "cafe", "n": 1}}<|eot_id|>', None),
}


@pytest.mark.parametrize("name", list(CALL_TURNS))
def test_a_sampled_tool_call_parses_to_the_shape_its_template_takes(name):
    """DeepSeek's templates concatenate the arguments string (a mapping fails) and render calls only
    when content is None (V3): the parse keeps the sampled JSON text and None. GLM's iterates the
    arguments as a mapping (decoded from the message's string, as the library does) and writes a None
    content as "None": the parse gives ''. The template, given the parsed turn in that shape, renders
    the ids that were sampled."""
    spec, r, hf = case(name)
    sample, content = CALL_TURNS[name]
    messages = opening(spec, None, "weather?")
    prompt = r.start(messages, TOOLS).prompt_ids
    completion = r.encode(sample)
    parsed = r.parse(completion, TOOLS, prompt)
    message = parsed.message
    assert parsed.closed and message["content"] == content
    (call,) = message["tool_calls"]
    assert isinstance(call["function"]["arguments"], str)
    answer = {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}
    rendered = template_text(spec, hf, [*messages, message, answer], TOOLS, False)
    sampled = r.decode(prompt + completion).removesuffix("<|observation|>")
    if spec.thinks_in_prompt:  # R1's template drops the reasoning of a past turn (a rewrite: a fork)
        sampled = sampled.replace("<think>\nhm\n</think>\n\n", "")
    if name == "deepseek-v3":  # V3's template does not close a lone call (test_deepseek_v3_deviation...)
        sampled = sampled.replace("<｜tool▁calls▁end｜><｜end▁of▁sentence｜>", "")
    assert rendered.startswith(sampled)


# ------------------------------------------------------------------ the library's known deviations, exactly


def test_deepseek_v3_deviation_tool_calls_follow_r1s_fixed_shape():
    """DeepSeek-V3's own template (Dec 2024) renders a call turn only when content is None, leaves a
    lone call without `<｜tool▁calls▁end｜><｜end▁of▁sentence｜>`; the library renders R1's shape for
    every call turn (what the model samples), so such history differs from V3's template exactly there."""
    spec, r, hf = case("deepseek-v3")
    call = {"id": "c0", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}
    for content in (None, "", "ok"):
        messages = [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": content, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c0", "content": "r"},
        ]
        ours = r.decode(r.start(messages, None).prompt_ids)
        block = (
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n"
            '{"q": "x"}\n```<｜tool▁call▁end｜>'
        )
        theirs = template_text(spec, hf, messages, None, True)
        if content is None:
            assert ours == theirs.replace(block, block + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>")
        else:  # the template drops the call
            assert ours == theirs.replace(
                f"{content}<｜end▁of▁sentence｜>",
                f"{content}{block}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
            )


def test_deepseek_r1_deviation_the_generation_prompt_after_tool_outputs_opens_reasoning():
    """R1's template adds no generation prompt after tool outputs; the library adds `<think>\\n` (the
    model reasons before answering a tool), and a second call turn in one conversation is rendered by
    the template as a continuation of the first (its `ns.is_first` never resets), by the library as a
    turn of its own."""
    spec, r, hf = case("deepseek-r1")
    call = {"id": "c0", "type": "function", "function": {"name": "search", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c0", "content": "r"},
    ]
    theirs = template_text(spec, hf, messages, TOOLS, True)
    assert r.decode(r.start(messages, TOOLS).prompt_ids) == theirs + "<think>\n"
    twice = [*messages, messages[1], messages[2]]
    ours, theirs = r.decode(r.start(twice, TOOLS).prompt_ids), template_text(spec, hf, twice, TOOLS, True)
    second = "<｜tool▁outputs▁end｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
    assert ours.count(second) == 1 and theirs.count(second) == 0


def test_kimi_k2_deviation_the_library_renders_a_later_template_revision():
    """The Kimi-K2-Instruct template at hand is the July-2025 revision; the library renders the later one
    (not to be had offline): its default system prompt, compact tool declarations, `functions.<name>:<i>`
    ids from the call's own id and a real newline in tool returns. With a system message, no tools and no
    calls the two agree (the property tests above)."""
    spec, r, hf = case("kimi-k2")
    bare = [{"role": "user", "content": "u"}]
    assert "You are Kimi, an AI assistant created by Moonshot AI." in r.decode(r.start(bare, None).prompt_ids)
    assert "You are a helpful assistant" in template_text(spec, hf, bare, None, True)
    tool_return = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "functions.search:0",
                    "type": "function",
                    "function": {"name": "search", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "functions.search:0", "content": "r"},
    ]
    assert "## Return of functions.search:0\nr" in r.decode(r.start(tool_return, None).prompt_ids)
    assert "## Return of functions.search:0\\nr" in template_text(spec, hf, tool_return, None, True)


def test_llama_3_deviation_3_2_dates_today_and_arguments_render_as_sampled():
    """Llama 3.2's template dates the system prompt today (`strftime_now`), the library "26 Jul 2024"
    unless `date_string` is given (as the property tests above give it). Llama's templates take a call's
    arguments as a mapping and write it with `tojson`; the library writes the arguments string as the
    model sampled it, so only a sample `tojson` would write otherwise (compact, escaped) re-renders
    differently (a fork where history is re-rendered)."""
    spec, r, hf = case("llama-3.2")
    bare = [{"role": "user", "content": "u"}]
    theirs = hf.apply_chat_template(bare, tokenize=False, add_generation_prompt=True)
    assert "Today Date: 26 Jul 2024" in r.decode(r.start(bare, None).prompt_ids)
    assert "Today Date: 26 Jul 2024" not in theirs and "Today Date: " in theirs
    spec, r, hf = case("llama-3.1")
    call = {"id": "c0", "type": "function", "function": {"name": "search", "arguments": '{"q":"caf\\u00e9"}'}}
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    ours = r.decode(r.render_ids(messages, None, False))
    assert ours == template_text(spec, hf, messages, None, False).replace(
        '{"q": "café"}', '{"q":"caf\\u00e9"}'
    )


def next_prompt(r: Renderer, prompt: list[int], completion: list[int], reply: Any) -> str:
    return r.decode(reply.prompt_ids if reply.forked else prompt + completion + reply.appended_ids)


def resplit(r: Renderer, ids: list[int], at: float) -> list[int]:
    """`ids` with their longest run of text tokens (no marker) encoded as two pieces split at `at`: the
    same text, other tokens (a marker's text split in two would be text, not the marker)."""
    markers = r.tokenizer.backend.get_added_tokens_decoder()
    runs, start = [], 0
    for i, token in enumerate([*ids, next(iter(markers))]):
        if token in markers:
            runs.append((start, i))
            start = i + 1
    lo, hi = max(runs, key=lambda run: run[1] - run[0])
    text = r.decode(ids[lo:hi])
    cut = int(len(text) * at)
    return ids[:lo] + r.encode(text[:cut]) + r.encode(text[cut:]) + ids[hi:]


@pytest.mark.parametrize("name", list(FAMILIES))
@PROFILE
@given(first=TEXT, turn=TURN, at=st.floats(0.05, 0.95))
def test_a_cut_or_non_canonically_split_sample_is_kept_as_sampled(name, first, turn, at):
    """A sample split into other tokens than the canonical encode (the same text) bridges as the
    canonical one does, fork for fork, to the same text; a sample cut by `length` is closed by the
    family's synthetic close and kept: the next prompt starts with exactly the prompt and the cut ids."""
    spec, r, hf = case(name)
    use = TOOLS if spec.calls else None
    content, reasoning, arguments, text, new_user = turn
    messages = opening(spec, None, first)
    prompt = r.start(messages, use).prompt_ids
    message = assistant(spec, content, reasoning, arguments)
    completion = sampled_turn(spec, r, hf, messages, message, use, prompt)
    body = completion[:-1]
    split = resplit(r, completion, at)
    new = answers(message, text, new_user)

    def bridged(ids: list[int]) -> Any:
        request = BridgeRequest(
            completion_ids=ids,
            new_messages=new,
            tools=use,
            prompt_tail=prompt,
            history=History(messages=messages, prompt_ids=prompt),
        )
        return r.bridge(request)

    canonical, other = bridged(completion), bridged(split)
    assert other.forked == canonical.forked
    assert next_prompt(r, prompt, split, other) == next_prompt(r, prompt, completion, canonical)

    lengthy = body[: max(1, int(len(body) * at))]
    reply = bridged(lengthy)
    assert reply.synthetic_close
    if not reply.forked:
        assert reply.synthetic_ids >= 1 and reply.appended_ids[reply.synthetic_ids - 1] in r.stop_ids
        assert (prompt + lengthy + reply.appended_ids)[: len(prompt) + len(lengthy)] == prompt + lengthy
    else:
        assert reply.fork_reason
