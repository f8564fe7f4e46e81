"""Model calls answered in vLLM's shapes: a validated request in, a serialised response body out.

Completions take token ids (the main path) or text; chat renders its messages with the tokenizer's chat
template (cached: a rollout resends its whole history every turn) and parses the sampled turn back into
`content` / `reasoning` / `tool_calls` the way vLLM's qwen3 reasoning parser and hermes tool parser do,
each only when the server runs with it. Both run the same `ScriptedPolicy` on prompt ids.

End of turn, as vLLM returns it: the close token `<|im_end|>` is the tokenizer's EOS, so when the policy
ends on it `finish_reason` is "stop", `stop_reason` is None, the id IS the last of `token_ids` (vLLM
appends the sampled EOS to the output ids before its stop check) and has a logprob, and `text` leaves it
out (`skip_special_tokens`). When `max_tokens` cuts the turn, `finish_reason` is "length".
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from rollout_actors.inference.standin.policy import PolicyConfig, Sampled, ScriptedPolicy
from rollout_actors.inference.standin.wire import (
    MAX_LOGPROBS,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProb,
    ChatLogProbs,
    ChatLogProbsContent,
    ChatMessage,
    CompletionChoice,
    CompletionLogProbs,
    CompletionResponse,
    FunctionCall,
    PerRequestMetrics,
    RequestError,
    ToolCall,
    UsageInfo,
)

RENDER_CACHE_SIZE = 1024  # distinct conversations in flight at once, roughly; each entry is its prompt ids
ALTERNATIVE_STRIDE = 7919  # spreads the made-up top-logprob alternatives over the vocabulary
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
"""vLLM 0.33.0 `Hermes2ProToolParser.tool_call_regex`: a closed call, or an unclosed one running to the end."""


@dataclass(frozen=True)
class Parsers:
    """What the server was started with (`--enable-auto-tool-choice`, `--tool-call-parser`,
    `--reasoning-parser`): without them vLLM parses neither tool calls nor reasoning."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


@dataclass
class Answer:
    body: bytes
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Draft:
    """One choice as the policy would sample it, before the engine runs it (pauses and weight updates
    can still cut it or resample its tail)."""

    prompt_ids: list[int]
    sampled: Sampled
    max_tokens: int
    spans: list[tuple[str, int]] = field(default_factory=list)
    """(weight version, first output index) for each run of tokens, in order."""


@dataclass
class Plan:
    """A validated model call: its request, the served name, and one draft per choice."""

    kind: str
    req: Any
    model: str
    seed: int
    config: PolicyConfig
    drafts: list[Draft]


class Answers:
    """Builds response bodies. One per server; holds the policy and the render/tokenise caches."""

    def __init__(self, policy: ScriptedPolicy, max_model_len: int, parsers: Parsers = Parsers()) -> None:
        self.policy = policy
        self.tokenizer = policy.tokenizer
        self.max_model_len = max_model_len
        self.parsers = parsers
        self.vocab_size = len(self.tokenizer)
        added = self.tokenizer.added_tokens_decoder
        self.regular_vocab = min(added) if added else self.vocab_size
        self._prompts: OrderedDict[str, list[int]] = OrderedDict()

    # -------------------------------------------------------------------------------------- planning

    def plan(self, kind: str, req: Any, model: str, seed: int, config: PolicyConfig) -> Plan:
        """Validate the request and draft every choice. RequestError (a 400) for what vLLM refuses."""
        if kind == "completions":
            _single_choice(req.n, req.stream)
            prompts = self._completion_prompts(req.prompt)
            limit, param = req.max_tokens, "max_tokens"
        else:
            _single_choice(req.n or 1, bool(req.stream))
            self._check_tool_choice(req)
            prompts = [self._render(req)]
            limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            if self.parsers.reasoning_parser is not None and _thinking(req):
                # A thinking Qwen3 always opens a think block, and vLLM's qwen3 parser reads a turn without
                # one as all reasoning: the scripted policy thinks on every such turn.
                config = dataclasses.replace(config, think_rate=1.0)
        _check_cache_salt(getattr(req, "cache_salt", None))
        drafts = []
        for prompt_ids in prompts:
            max_tokens = self._max_tokens(prompt_ids, limit, param)
            check_sampling(req.temperature, req.top_p, max_tokens)
            self._check_logprobs(req.logprobs if kind == "completions" else req.logprobs and req.top_logprobs)
            sampled = self._sample(prompt_ids, req, max_tokens, seed, config)
            drafts.append(Draft(prompt_ids, sampled, max_tokens))
        return Plan(kind, req, model, seed, config, drafts)

    def _check_logprobs(self, count: int | None) -> None:
        """vLLM 0.33.0 `SamplingParams._validate_logprobs` at the default `--max-logprobs` (-1: the whole
        vocabulary)."""
        count = self.vocab_size if count == -1 else count
        if count and count > MAX_LOGPROBS:
            raise RequestError(
                f"Requested sample logprobs of {count}, which is greater than max allowed: {MAX_LOGPROBS}",
                "logprobs",
                count,
            )

    def resample_tail(self, plan: Plan, draft: Draft, keep: int, seed: int) -> None:
        """New weights landed after `keep` tokens: the rest of the turn is sampled by the new policy,
        continuing from exactly the tokens already sampled."""
        head = draft.sampled
        tail = self._sample(
            draft.prompt_ids + head.ids[:keep], plan.req, draft.max_tokens - keep, seed, plan.config
        )
        ids = head.ids[:keep] + tail.ids
        draft.sampled = Sampled(
            ids,
            head.logprobs[:keep] + tail.logprobs,
            self.tokenizer.decode(ids, skip_special_tokens=True),
            tail.finish_reason,
            tail.stop_reason,
            tail.script,
        )

    def cut(self, draft: Draft, keep: int, finish_reason: str) -> None:
        """The turn ends after `keep` tokens (an abort): what was sampled so far, as sampled."""
        ids = draft.sampled.ids[:keep]
        draft.sampled = Sampled(
            ids,
            draft.sampled.logprobs[:keep],
            self.tokenizer.decode(ids, skip_special_tokens=True),
            finish_reason,  # type: ignore[arg-type]
            None,
            draft.sampled.script,
        )

    def body(self, plan: Plan, metrics: PerRequestMetrics | None = None) -> Answer:
        """The response; `metrics` only when the server was started with `--enable-per-request-metrics`."""
        if plan.kind == "completions":
            return self._completion_body(plan, metrics)
        return self._chat_body(plan, metrics)

    # ------------------------------------------------------------------------------------ completions

    def _completion_body(self, plan: Plan, metrics: PerRequestMetrics | None = None) -> Answer:
        req = plan.req
        choices, used, produced = [], 0, 0
        for index, draft in enumerate(plan.drafts):
            sampled = draft.sampled
            logprobs = None
            if req.logprobs is not None:
                logprobs = self._completion_logprobs(sampled, req.logprobs, req.return_tokens_as_token_ids)
            choices.append(
                CompletionChoice(
                    index=index,
                    text=sampled.text,
                    logprobs=logprobs,
                    finish_reason=sampled.finish_reason,
                    stop_reason=sampled.stop_reason,
                    token_ids=sampled.ids if req.return_token_ids else None,
                    prompt_token_ids=draft.prompt_ids if req.return_token_ids else None,
                    weight_versions=_spans(draft) if req.return_weight_versions else None,
                )
            )
            used, produced = used + len(draft.prompt_ids), produced + len(sampled.ids)
        usage = UsageInfo(prompt_tokens=used, completion_tokens=produced, total_tokens=used + produced)
        body = CompletionResponse(
            model=plan.model, choices=choices, usage=usage, metrics=metrics
        ).model_dump_json()
        return Answer(body.encode(), used, produced)

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [self._encode(prompt)]
        elif prompt and isinstance(prompt[0], str):
            prompts = [self._encode(p) for p in prompt]
        elif prompt and isinstance(prompt[0], list):
            prompts = prompt
        elif prompt:
            prompts = [prompt]
        else:  # vLLM 0.33 reads `[]` as no prompt at all (`prompt_to_seq`), `[[]]` as one empty prompt
            prompts = []
        if not prompts:
            raise RequestError("You must pass at least one prompt", "prompt")
        for ids in prompts:
            # vLLM 0.33's `InputProcessor._validate_prompt_len` and `BaseRenderer.validate_token_ids`
            if not ids:
                raise RequestError("The decoder prompt cannot be empty", None)
            if min(ids) < 0:
                raise RequestError(f"Token id {min(ids)} is out of vocabulary", None)
            if max(ids) >= self.vocab_size:
                raise RequestError(f"Token id {max(ids)} is out of vocabulary", None)
        return prompts

    def _completion_logprobs(self, sampled: Sampled, top: int, as_ids: bool | None) -> CompletionLogProbs:
        tokens, offsets, tops, offset = [], [], [], 0
        for token_id, logprob in zip(sampled.ids, sampled.logprobs, strict=True):
            token = self._token(token_id, as_ids)
            tokens.append(token)
            offsets.append(offset)
            offset += len(token) if token_id != self.policy.im_end else 0
            runners_up = _alternatives(token_id, logprob, top, self.regular_vocab)
            tops.append({token: logprob, **{self._token(a, as_ids): lp for a, lp in runners_up}})
        return CompletionLogProbs(
            text_offset=offsets, token_logprobs=list(sampled.logprobs), tokens=tokens, top_logprobs=tops
        )

    # ------------------------------------------------------------------------------------------- chat

    def _check_tool_choice(self, req: ChatCompletionRequest) -> None:
        """vLLM's rule (0.33.0, `vllm/renderers/online_renderer.py`): tools without `tool_choice` mean
        "auto", which needs `--enable-auto-tool-choice` and `--tool-call-parser`; "required" or a named
        tool needs the parser."""
        if not req.tools and req.tool_choice not in (None, "none"):
            raise RequestError("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if not req.tools or self.parsers.tool_call_parser is not None:
            if req.tools and req.tool_choice in (None, "auto") and not self.parsers.enable_auto_tool_choice:
                raise RequestError(AUTO_TOOLS_NEED_FLAGS)
            return
        if req.tool_choice in (None, "auto"):
            raise RequestError(AUTO_TOOLS_NEED_FLAGS)
        if req.tool_choice != "none":
            raise RequestError(
                f"tool_choice={json.dumps(req.tool_choice)} requires --tool-call-parser to be set"
            )

    def _chat_body(self, plan: Plan, metrics: PerRequestMetrics | None = None) -> Answer:
        req, (draft,) = plan.req, plan.drafts
        sampled = draft.sampled
        parse_tools = (
            bool(req.tools) and req.tool_choice != "none" and self.parsers.tool_call_parser is not None
        )
        message = parse_turn(
            sampled.text, parse_tools, self.parsers.reasoning_parser is not None, _thinking(req)
        )
        finish = "tool_calls" if message.tool_calls else sampled.finish_reason
        logprobs = None
        if req.logprobs:
            logprobs = self._chat_logprobs(sampled, req.top_logprobs or 0, req.return_tokens_as_token_ids)
        choice = ChatChoice(
            index=0,
            message=message,
            logprobs=logprobs,
            finish_reason=finish,
            stop_reason=sampled.stop_reason,
            token_ids=sampled.ids if req.return_token_ids else None,
            weight_versions=_spans(draft) if req.return_weight_versions else None,
        )
        used, produced = len(draft.prompt_ids), len(sampled.ids)
        usage = UsageInfo(prompt_tokens=used, completion_tokens=produced, total_tokens=used + produced)
        response = ChatCompletionResponse(
            model=plan.model,
            choices=[choice],
            usage=usage,
            prompt_token_ids=draft.prompt_ids if req.return_token_ids else None,
            metrics=metrics,
        )
        return Answer(response.model_dump_json().encode(), used, produced)

    def _render(self, req: ChatCompletionRequest) -> list[int]:
        kwargs = dict(req.chat_template_kwargs or {})
        key = json.dumps([req.messages, req.tools, kwargs, req.add_generation_prompt], sort_keys=True)
        cached = self._prompts.get(key)
        if cached is not None:
            self._prompts.move_to_end(key)
            return cached
        try:
            text = self.tokenizer.apply_chat_template(
                [_template_message(m) for m in req.messages],
                tools=req.tools,
                add_generation_prompt=req.add_generation_prompt,
                tokenize=False,
                **kwargs,
            )
        except Exception as exc:  # jinja errors on a malformed conversation are the caller's
            raise RequestError(f"chat template failed: {type(exc).__name__}: {exc}", "messages") from exc
        ids = self._encode(text)
        self._prompts[key] = ids
        if len(self._prompts) > RENDER_CACHE_SIZE:
            self._prompts.popitem(last=False)
        return ids

    def _chat_logprobs(self, sampled: Sampled, top: int, as_ids: bool | None) -> ChatLogProbs:
        content = []
        for token_id, logprob in zip(sampled.ids, sampled.logprobs, strict=True):
            entry = self._chat_logprob(token_id, logprob, as_ids)
            ranked = [entry] + [
                self._chat_logprob(a, lp, as_ids)
                for a, lp in _alternatives(token_id, logprob, top, self.regular_vocab)
            ]
            content.append(ChatLogProbsContent(**entry.model_dump(), top_logprobs=ranked[:top]))
        return ChatLogProbs(content=content)

    def _chat_logprob(self, token_id: int, logprob: float, as_ids: bool | None) -> ChatLogProb:
        raw = list(self.policy.pieces.bytes(token_id))
        return ChatLogProb(token=self._token(token_id, as_ids), logprob=logprob, bytes=raw)

    # ----------------------------------------------------------------------------------------- shared

    def _sample(
        self, prompt_ids: list[int], req: Any, max_tokens: int, seed: int, config: PolicyConfig
    ) -> Sampled:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
        return self.policy.complete(
            prompt_ids,
            max_tokens=max_tokens,
            seed=seed,
            temperature=req.temperature,
            stop=stop,
            stop_token_ids=req.stop_token_ids or (),
            include_stop_str_in_output=req.include_stop_str_in_output,
            config=config,
        )

    def _max_tokens(self, prompt_ids: list[int], requested: int | None, param: str = "max_tokens") -> int:
        """vLLM 0.33's output budget: a request for more than the context is refused (`TokenizeParams`),
        a prompt that fills it is refused (`_token_len_check`, `_validate_prompt_len`), and a request for
        more than the room after the prompt is clamped to that room (`get_max_tokens`), not refused."""
        limit, length = self.max_model_len, len(prompt_ids)
        if requested is not None and requested > limit:
            raise RequestError(
                f"{param}={requested} cannot be greater than max_model_len={limit}. "
                "Please request fewer output tokens.",
                param,
                requested,
            )
        if length > limit:  # "at least" where vLLM's tokenizer may have cut the prompt at limit + 1
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"{'at least ' if length == limit + 1 else ''}{length} input tokens, which exceeds this limit even without any output tokens. Please "
                "reduce the length of the input prompt.",
                "input_tokens",
                length,
            )
        if length == limit:
            raise RequestError(
                f"The decoder prompt (length {length}) plus the number of requested output tokens (at least "
                f"1) is longer than the maximum model length of {limit}. Make sure that `max_model_len` is "
                "no smaller than the number of text tokens (prompt + requested output tokens).",
                None,
            )
        room = limit - length
        return room if requested is None else min(requested, room)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _token(self, token_id: int, as_ids: bool | None) -> str:
        return f"token_id:{token_id}" if as_ids else self.policy.pieces.text(token_id)


def parse_turn(
    text: str, parse_tools: bool, parse_reasoning: bool = True, thinking: bool = True
) -> ChatMessage:
    """Split an assistant turn as vLLM 0.33.0's `qwen3` reasoning parser and `hermes` tool parser do (each
    only when the server runs with it; tests compare this with vLLM's own on canned turns).

    Reasoning (`vllm/parser/qwen3.py`): with thinking on (`chat_template_kwargs.enable_thinking`, default
    true) a turn starts IN reasoning (Qwen3's template may open `<think>` in the prompt); it ends at
    `</think>` or at the first `<tool_call>`; a turn with neither is all reasoning and has no content.
    Nothing is stripped but the tags. Tool calls (`hermes`): every `<tool_call>` body, the last one also
    without its `</tool_call>`, must be a JSON object with `name` and `arguments`, else the whole text stays
    content; the content is what precedes the first call."""
    reasoning, content = None, text
    if parse_reasoning and thinking:
        body = text[len("<think>") :] if text.startswith("<think>") else text
        ends = [i for i in (body.find("</think>"), body.find("<tool_call>")) if i >= 0]
        if not ends:
            reasoning, content = body, ""
        else:
            end = min(ends)
            reasoning = body[:end]
            content = body[end + len("</think>") :] if body.startswith("</think>", end) else body[end:]
    calls: list[ToolCall] = []
    if parse_tools and "<tool_call>" in content:
        try:
            for closed, unclosed in _TOOL_CALL.findall(content):
                call = json.loads(closed or unclosed)
                arguments = json.dumps(call["arguments"], ensure_ascii=False)
                calls.append(ToolCall(function=FunctionCall(name=call["name"], arguments=arguments)))
        except (ValueError, KeyError, TypeError, AttributeError):
            calls = []
        if calls:
            content = content[: content.find("<tool_call>")]
    return ChatMessage(content=content or None, reasoning=reasoning or None, tool_calls=calls)


def check_sampling(temperature: float | None, top_p: float | None, max_tokens: int) -> None:
    """vLLM 0.33.0 `SamplingParams._verify_args`, in its order, for the fields the stand-in samples with:
    a 400 `BadRequestError` naming the parameter, with vLLM's message (`VLLMValidationError.__str__`)."""
    checks: list[tuple[str, Any, bool, str]] = []
    if temperature is not None:
        checks += [
            ("temperature", temperature, math.isfinite(temperature), "must be a finite number"),
            ("temperature", temperature, temperature >= 0.0, "must be non-negative"),
            ("temperature", temperature, temperature <= 2.0, "must be in [0, 2]"),
        ]
    if top_p is not None:
        checks.append(("top_p", top_p, 0.0 < top_p <= 1.0, "must be in (0, 1]"))
    checks.append(("max_tokens", max_tokens, max_tokens >= 1, "must be at least 1"))
    for name, value, ok, rule in checks:
        if not ok:
            raise RequestError(f"{name} {rule}, got {value}.", name, value)


AUTO_TOOLS_NEED_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)
_CACHE_SALT_FORBIDDEN = set("@/\\\x00")


def _check_cache_salt(salt: Any) -> None:
    """vLLM 0.33.0 `validate_cache_salt`: a non-empty string of at most 128 characters without @ / \\ NUL."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise RequestError("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    if len(salt) > 128 or set(salt) & _CACHE_SALT_FORBIDDEN:
        raise RequestError(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', "
            "or NUL.",
            "cache_salt",
        )


def _thinking(req: Any) -> bool:
    """Qwen3's `enable_thinking` (chat template kwarg, default on), as vLLM's qwen3 parser reads it."""
    return (req.chat_template_kwargs or {}).get("enable_thinking", True) is not False


def _spans(draft: Draft) -> list[dict[str, Any]]:
    """vLLM's `weight_versions`: contiguous [start, end) output ranges and the weights that sampled them."""
    spans = draft.spans or [("default", 0)]
    ends = [start for _, start in spans[1:]] + [len(draft.sampled.ids)]
    return [{"version": v, "start": start, "end": end} for (v, start), end in zip(spans, ends, strict=True)]


def _alternatives(token_id: int, logprob: float, top: int, regular: int) -> list[tuple[int, float]]:
    """Made-up runners-up for `top_logprobs`: deterministic ordinary-vocabulary ids (below `regular`),
    each less likely than the sampled token."""
    return [
        ((token_id + ALTERNATIVE_STRIDE * k) % regular, round(logprob - 0.75 * k - 0.5, 6))
        for k in range(1, top)
    ]


def _single_choice(n: int, stream: bool) -> None:
    if n != 1:
        raise RequestError("the stand-in server samples one choice per prompt (n=1)", "n")
    if stream:
        raise RequestError("the stand-in server does not stream", "stream")


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI message -> what the chat template reads: text content; the reasoning under both names, as
    vLLM 0.33 hands it over (`reasoning`, else the deprecated `reasoning_content` it renames)."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    elif content is None and out.get("role") != "assistant":
        out["content"] = ""
    reasoning = out.pop("reasoning_content", None) if out.get("reasoning") is None else out.get("reasoning")
    out.pop("reasoning_content", None)
    if reasoning is not None:
        out["reasoning"] = out["reasoning_content"] = reasoning
    return out
