"""The families held to their models' own chat templates (issue #45): each case, its renderer and the
template's reference render, the hypothesis strategies, and how a model of the family samples a turn.
Shared by `test_family_templates.py` (the properties, every family) and the per-group deviation tests
(`test_family_deepseek.py`, `test_family_gpt_oss.py`, `test_family_deviations.py`).

The templates are the models' own (`trl/chat_templates/` where the `trl` wheel ships the family, else
`tests/templates/` with a `.source.txt` each); the vocabularies are gpt-oss's real one and, for the
others, stand-ins carrying each family's special tokens as single ids (`family_tokenizers.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from family_tokenizers import reference_template, template_variant, trl_template
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

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
    system: bool = True
    """A system message renders as the library renders it (False: a known deviation, asserted apart)."""
    needs_system: bool = False
    """Without a system message the template's default system prompt is not the library's (deviation)."""
    one_call_turn: bool = False
    """The template renders a second tool-call turn of a conversation as a continuation of the first
    (its `ns.is_first` is never reset: deviation): conversations here hold one."""
    thinking_field: str | None = None
    """The template reads a turn's reasoning under this name, and the family's model always opens its
    turn with reasoning, possibly empty (gpt-oss: `thinking`, the analysis channel)."""
    prompt_suffix: str = ""
    """What the library's generation prompt adds after the template's (gpt-oss: it opens the analysis
    channel the model would open itself; a deviation, asserted exactly apart)."""
    vocabulary: str | None = None
    """The tokenizer (`family_tokenizers.tokenizer_dir` name) where it is not the library family's."""
    options: dict[str, Any] = field(default_factory=dict)
    """The renderer config's `options` (the `default` family's tool parser)."""

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
    "gpt-oss": Family(
        "gpt-oss",
        "trl:gptoss",
        calls=False,
        system=False,
        thinking_field="thinking",
        prompt_suffix="<|channel|>analysis<|message|>",
    ),
    "deepseek-r1-distill": Family(
        "deepseek-r1", "trl:deepseek_r1_distill", calls=False, thinks_in_prompt=True
    ),
    "deepseek-r1-distill-default": Family(
        "default",
        "trl:deepseek_r1_distill",
        calls=False,
        thinks_in_prompt=True,
        vocabulary="deepseek-r1",
        options={"tool_parser": "deepseek-v3"},
    ),
    "deepseek-v3.1-default": Family(
        "default",
        "ref:deepseek-ai--DeepSeek-V3.1",
        calls=False,
        vocabulary="deepseek-v3",
    ),
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
        model = template_variant(name, spec.text(), family=spec.vocabulary or spec.family)
        config = RendererConfig(
            family=spec.family, template_kwargs=spec.template_kwargs, options=spec.options
        )
        _LOADED[name] = (Renderer.load(RendererKey.from_config(model, config)), load_tokenizer(model))
    return (spec, *_LOADED[name])


def shaped(spec: Family, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to the family's template: an assistant's `reasoning` under both
    names, arguments decoded where the template wants a mapping."""
    out = []
    for m in messages:
        if m.get("reasoning") is not None:
            m = {**m, "reasoning_content": m["reasoning"]}
            if spec.thinking_field:
                m[spec.thinking_field] = m["reasoning"]
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
    """The reference: the template's own render, tokenised by Hugging Face (with the generation prompt,
    the family's known `prompt_suffix` after it)."""
    text = template_text(spec, hf, messages, tools, add_generation_prompt)
    return hf.encode(text + (spec.prompt_suffix if add_generation_prompt else ""), add_special_tokens=False)


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
    if spec.thinking_field:
        message[spec.thinking_field] = message["reasoning_content"] = reasoning or ""
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
    system = system if spec.system else None
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
