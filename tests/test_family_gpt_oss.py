"""gpt-oss (harmony) against its model's own template (`trl` `gptoss.jinja`, gpt-oss-20b = 120b), on its
real vocabulary: the tool-call shape the template takes and each place where the library (harmony's own
encoder, as vLLM 0.33 serves gpt-oss) departs from the template, asserted exactly. The properties every
family holds are in `test_family_templates.py`."""

from __future__ import annotations

import json
from typing import Any

import pytest
from family_cases import TOOLS, case

from renderer_actors.calls import BridgeRequest, History

DESCRIBED = [{"type": "function", "function": {**TOOLS[0]["function"], "description": "Search."}}]
"""The template reads `description` (it raises without one)."""
SAMPLED_CALL = (
    "need search<|end|><|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json"
    '<|message|>{"q": "café", "n": 1}<|call|>'
)
"""What gpt-oss samples for a call after the generation prompt (which opened the analysis channel)."""


def as_template_takes(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A parsed call turn as gpt-oss's template takes it: reasoning as `thinking`, arguments as a
    mapping (it writes them with `tojson`: a string would be quoted)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
            m = {k: v for k, v in m.items() if k != "reasoning"} | {
                "thinking": m["reasoning"],
                "tool_calls": calls,
            }
        out.append(m)
    return out


def test_the_vocabulary_is_harmonys_own():
    """The Hugging Face tokenizer built here and harmony's encoder (which the library renders with) give
    the same ids, special tokens included."""
    _, r, hf = case("gpt-oss")
    text = '<|start|>user<|message|>café 東京 12345  \n\n x {"a": 1}<|end|><|start|>assistant<|channel|>'
    harmony = r.library._enc.encode(text, allowed_special="all")
    assert hf.encode(text, add_special_tokens=False) == harmony == r.encode(text)
    assert hf.convert_tokens_to_ids(["<|return|>", "<|call|>", "<|constrain|>"]) == [200002, 200012, 200003]


def test_a_sampled_call_parses_to_the_shape_the_template_takes_and_bridges_named():
    """A sampled call parses to `''` content (the template tests `in` on it: `None` fails) and the
    arguments as sampled; given that turn, the template renders it as the library does except where the
    library follows harmony (asserted exactly): no `json` content type after the channel, the tool's
    answer as written (the template quotes it with `tojson`), and the analysis channel opened. The
    bridge keeps the sample and names the answer's author after the call (not `functions.unknown`)."""
    spec, r, hf = case("gpt-oss")
    messages = [{"role": "user", "content": "weather?"}]
    prompt = r.start(messages, DESCRIBED).prompt_ids
    completion = r.encode(SAMPLED_CALL)
    parsed = r.parse(completion, DESCRIBED, prompt)
    message = parsed.message
    assert parsed.closed and message["content"] == "" and message["reasoning"] == "need search"
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "search", "arguments": '{"q": "café", "n": 1}'}
    answer = {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}
    conversation = [*messages, message, answer]

    silent = as_template_takes([*messages, {**message, "content": None}, answer])
    with pytest.raises(TypeError, match="NoneType"):
        hf.apply_chat_template(silent, tools=DESCRIBED, tokenize=False, add_generation_prompt=True)
    theirs = hf.apply_chat_template(
        as_template_takes(conversation), tools=DESCRIBED, tokenize=False, add_generation_prompt=True
    )
    ours = r.decode(r.render_ids(conversation, DESCRIBED, True))
    assert ours == (
        theirs.replace("<|channel|>commentary json<|message|>", "<|channel|>commentary<|message|>").replace(
            '<|message|>"sunny"<|end|>', "<|message|>sunny<|end|>"
        )
        + spec.prompt_suffix
    )
    assert "<|start|>assistant<|channel|>analysis<|message|>need search<|end|>" in theirs  # a live cycle

    reply = r.bridge(
        BridgeRequest(
            completion_ids=completion,
            new_messages=[answer],
            tools=DESCRIBED,
            prompt_tail=prompt,
            history=History(messages=messages, prompt_ids=prompt),
        )
    )
    assert not reply.forked and not reply.synthetic_close
    assert r.decode(reply.appended_ids) == (
        "<|start|>functions.search to=assistant<|channel|>commentary<|message|>sunny<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>"
    )


def test_gpt_oss_deviation_system_message_and_generation_prompt():
    """The template ends a developer message's instructions with a blank line even without tools, and
    its generation prompt is `<|start|>assistant`; harmony (the library, and vLLM's gpt-oss path)
    writes no blank line there and opens the analysis channel the model would open itself."""
    spec, r, hf = case("gpt-oss")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "u"}]
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ours = r.decode(r.start(messages, None).prompt_ids)
    assert theirs.endswith("<|start|>assistant")
    assert ours == theirs.replace("Be brief.\n\n<|end|>", "Be brief.<|end|>") + spec.prompt_suffix
    with_tools = r.decode(r.start(messages, DESCRIBED).prompt_ids)
    assert with_tools == (
        hf.apply_chat_template(messages, tools=DESCRIBED, tokenize=False, add_generation_prompt=True)
        + spec.prompt_suffix
    )
