"""Kimi K2 and Llama 3 where the library departs from their templates: each departure asserted exactly
(the properties every family holds are in `test_family_templates.py`)."""

from __future__ import annotations

from family_cases import case, template_text


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
