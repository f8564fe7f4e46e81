"""Every tested family's bridge, parse and fork paths over random conversations (hypothesis).

For each family (Qwen3 on the bundled tokenizer; DeepSeek V3 and R1, GLM 4.5, Kimi K2 and Llama 3 on
small offline tokenizers with the family's special tokens; gpt-oss on its real o200k_harmony vocabulary)
and every turn of a random conversation:

- the next prompt starts with exactly the previous prompt + the sampled completion, or the step forked,
  said why, and its prompt is the template's full render;
- bridging from the prompt's tail (what the session sends) gives the same ids as bridging from the whole
  prompt (what makes a bridge cost the same at turn 100 as at turn 1);
- a turn that was closed by the model (and has no edge whitespace a template would trim) and not
  forked reads, as text, exactly as the template renders the whole conversation (the library's
  extension is the template's, up to how the sample was split).
"""

from __future__ import annotations

from typing import Any

import pytest
from family_tokenizers import tokenizer_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from renderer_actors.calls import BridgeRequest, History
from renderer_actors.config import RendererConfig
from renderer_actors.key import RendererKey
from renderer_actors.renderer import Renderer

FAMILIES = ["qwen3", "deepseek-v3", "deepseek-r1", "glm-4.5", "kimi-k2", "llama-3", "gpt-oss"]
_LOADED: dict[str, Renderer] = {}


def family_renderer(family: str) -> Renderer:
    if family not in _LOADED:
        model = tokenizer_dir(family)
        _LOADED[family] = Renderer.load(RendererKey.from_config(model, RendererConfig(family=family)))
    return _LOADED[family]


def natural_close(r: Renderer, family: str, next_role: str) -> int:
    """The stop token a model of this family samples to end its turn before a message of `next_role`."""
    tok = r.tokenizer.convert_tokens_to_ids
    if family == "glm-4.5":
        return tok("<|user|>" if next_role == "user" else "<|observation|>")
    if family == "gpt-oss":
        return tok("<|return|>")
    return r.library.get_stop_token_ids()[0]


TEXT = (
    st.lists(
        st.sampled_from(
            [
                "the ",
                "word ",
                "json",
                "js",
                "on",
                "café",
                "cafe\u0301",
                "東京",
                " ",
                "\n",
                "{",
                "}",
                '"',
                ".",
                "42",
            ]
        ),
        min_size=1,
        max_size=12,
    )
    .map("".join)
    .filter(lambda s: s.strip() != "")
)
TURN = st.tuples(
    TEXT,  # what the model wrote
    st.booleans(),  # split non-canonically (two encodes)
    st.booleans(),  # closed by a stop token (else cut by length)
    st.lists(st.tuples(st.sampled_from(["user", "tool"]), TEXT), min_size=1, max_size=2),
)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(system=st.one_of(st.none(), TEXT), first=TEXT, turns=st.lists(TURN, min_size=1, max_size=4))
def test_random_conversations_extend_exactly_or_fork_explicitly(family, system, first, turns):
    r = family_renderer(family)
    messages: list[dict[str, Any]] = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": first}
    ]
    prompt = r.start(messages, None).prompt_ids
    tail = list(prompt)
    faithful = True  # every sample so far is one the template would re-render as it was written
    for text, split, closed, new in turns:
        new_messages = [{"role": role, "content": content} for role, content in new]
        cut = len(text) // 2
        completion = r.encode(text[:cut]) + r.encode(text[cut:]) if split else r.encode(text)
        if closed:
            completion.append(natural_close(r, family, new_messages[0]["role"]))
        request = BridgeRequest(completion_ids=completion, new_messages=new_messages, prompt_tail=tail)

        from_tail = r._library_extension(request)
        from_whole = r._library_extension(request.model_copy(update={"prompt_tail": prompt}))
        assert from_tail == from_whole

        reply = r.bridge(request)
        if reply.needs_history:
            request.history = History(messages=messages, prompt_ids=prompt)
            reply = r.bridge(request)
        messages = [*messages, reply.assistant_message, *new_messages]
        if reply.forked:
            assert reply.fork_reason
            assert reply.prompt_ids == r.render_ids(messages, None, True)
            prompt = tail = list(reply.prompt_ids)
            faithful = True
            continue
        before = prompt + completion
        prompt = before + reply.appended_ids
        tail = list(reply.appended_ids)
        assert prompt[: len(before)] == before
        assert reply.synthetic_close == (not closed)
        faithful = faithful and closed and text == text.strip()  # templates trim; samples keep it
        if faithful:
            template = r.tokenizer.normalize(r.decode(r.render_ids(messages, None, True)))
            assert r.tokenizer.normalize(r.decode(prompt)) == template


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_parses_reasoning_and_content_by_its_own_markers(family):
    r = family_renderer(family)
    prompt = r.start([{"role": "user", "content": "hi"}], None).prompt_ids
    prefilled = r.decode(prompt).endswith("<think>\n")  # DeepSeek R1 opens the think block itself
    thinks = family != "llama-3"  # Llama 3 has no reasoning channel
    body = ("" if prefilled else "<think>\n") + "let me see\n</think>\n\n" if thinks else ""
    if family == "gpt-oss":  # harmony: the prompt opened the analysis channel; the answer is a final one
        body = "let me see<|end|><|start|>assistant<|channel|>final<|message|>"
    body += "The answer is 42."
    completion = r.encode(body) + [natural_close(r, family, "user")]
    parsed = r.parse(completion, None, prompt)
    assert parsed.closed and parsed.content.strip() == "The answer is 42."
    if thinks:
        assert parsed.reasoning.strip() == "let me see"
