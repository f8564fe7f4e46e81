"""Every library family against its model's own chat template (issue #45), property-tested.

The cases, templates and vocabularies are `family_cases.py`'s. For each family, over conversations within what its template renders as the library does:

1. the first render is the template's (text and ids);
2. a bridge forks exactly when the template's re-render of the longer conversation does not begin with
   the trajectory (prompt + the sampled turn), and an unforked prompt is the template's render (text);
3. a sampled tool call parses back to a message in the shape the template takes (DeepSeek: arguments as
   a JSON string and `None` content; GLM: arguments as a mapping, `''` content) that renders the ids
   that were sampled (gpt-oss and R1-Distill: their group files);
4. a sample split into other tokens than the canonical encode bridges to the same text, fork for fork,
   and one cut by `length` is closed synthetically and kept as sampled.

Where the library departs from a template the departure is asserted exactly, per family group
(`test_family_deepseek.py`, `test_family_gpt_oss.py`, `test_family_deviations.py`), and listed in the
family table (`docs/families.md`). Qwen3's own templates are in `test_template_fidelity.py`.
"""

from __future__ import annotations

from typing import Any

import pytest
from family_cases import (
    FAMILIES,
    PROFILE,
    TEXT,
    TOOLS,
    TURN,
    answers,
    assistant,
    case,
    next_prompt,
    opening,
    resplit,
    sampled_turn,
    template,
    template_text,
)
from hypothesis import given
from hypothesis import strategies as st

from renderer_actors.calls import BridgeRequest, History


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
