"""DeepSeek's templates (V3, R1, V3.1, R1-Distill) where the library departs from them: each departure
asserted exactly (the properties every family holds are in `test_family_templates.py`)."""

from __future__ import annotations

from family_cases import TOOLS, case, template_text


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
