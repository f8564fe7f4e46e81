"""The stand-in server's scripted policy: a seeded, deterministic assistant that answers in token ids.

It reads only the tail of a chat-formatted prompt (the generation prompt and the message before it, plus
the system message for the tool list), recognises the two bundled environments (math word problems,
the calculator tool) and otherwise writes free text from the tokenizer's vocabulary. Every turn ends with
`<|im_end|>` unless `max_tokens` cuts it. Same prompt ids + same seed -> same completion, ids and logprobs.

With `noncanonical_rate` > 0 a turn sometimes spells one word with two tokens although the BPE encodes it
as one ("json" as "js" + "on"): re-encoding the decoded text then gives different ids, which is how tests
prove a rollout keeps the sampled ids rather than re-tokenising text.
"""

from __future__ import annotations

import hashlib
import random
import re
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rollout_actors.inference.standin.scripts import PromptView, Script, scripted_turn

COMPLETION_CACHE_SIZE = 4096  # benchmarks send thousands of identical prompts; a turn is ~1-5 KB
WORD_POOL_SIZE = 4000  # the lowest BPE ranks are the most frequent words: plausible-looking text
_WORD_TOKEN = re.compile(r"Ġ[a-z]{3,10}")
_SPLITTABLE = re.compile(r"Ġ?[A-Za-z]{3,}")


@dataclass(frozen=True)
class PolicyConfig:
    """How the scripted policy behaves. Server-wide defaults, overridable per request by header."""

    seed: int = 0
    """Used when a request carries no seed."""
    correct_rate: float = 0.7
    """Probability that a math or calculator answer is right."""
    think_rate: float = 0.5
    """Probability that a turn opens with a `<think>` block (never when the prompt closed thinking)."""
    noncanonical_rate: float = 0.0
    """Probability that a turn spells one word with a non-canonical pair of tokens."""

    def __post_init__(self) -> None:
        for name in ("correct_rate", "think_rate", "noncanonical_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {value}")


@dataclass
class Sampled:
    """One sampled turn, clipped by `max_tokens` / stop conditions, as vLLM would return it."""

    ids: list[int]
    """Completion ids; ends with the close token when `finish_reason` is "stop" on it (as vLLM does)."""
    logprobs: list[float]
    """One per id."""
    text: str
    """Decoded without special tokens, cut before a matched stop string."""
    finish_reason: Literal["stop", "length"]
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the turn; None for the close token (vLLM's rule)."""
    script: str = "free"
    """Which scripted behaviour produced it: "math", "tool_call", "tool_answer" or "free"."""


@dataclass(frozen=True)
class _Turn:
    """The whole turn the policy meant to say, before clipping (what the cache holds)."""

    ids: list[int]
    logprobs: list[float]
    script: str


class TokenPieces:
    """Raw bytes and display text of single token ids, cached (a vocabulary-sized table at most)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._byte_of = {ch: b for b, ch in _bytes_to_unicode().items()}
        self._added = {i for i in tokenizer.added_tokens_decoder}
        self._bytes: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        cached = self._bytes.get(token_id)
        if cached is not None:
            return cached
        piece = self._tokenizer.convert_ids_to_tokens(token_id) or ""
        if token_id in self._added or any(ch not in self._byte_of for ch in piece):
            value = piece.encode() if token_id in self._added else self._decode_one(token_id)
        else:
            value = bytes(self._byte_of[ch] for ch in piece)
        self._bytes[token_id] = value
        return value

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")

    def _decode_one(self, token_id: int) -> bytes:
        return self._tokenizer.decode([token_id]).encode()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (shared by Qwen): printable bytes map to themselves, the rest above 255."""
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


HEAD_TOKENS = 8  # enough for a message's role line and the `<tool_response>` marker after it
TOOL_RESPONSE = "<tool_response>"
RFIND_CHUNK = 2048


class ScriptedPolicy:
    """Turns prompt ids into a completion. Construct once per server (it indexes the vocabulary):

    `ScriptedPolicy(load_tokenizer(), PolicyConfig(seed=0)).complete(prompt_ids, max_tokens=256)`
    """

    def __init__(self, tokenizer: Any, config: PolicyConfig = PolicyConfig()) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.pieces = TokenPieces(tokenizer)
        self.im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        vocab: dict[str, int] = tokenizer.get_vocab()
        self._vocab = vocab
        words = sorted((i, s[1:]) for s, i in vocab.items() if _WORD_TOKEN.fullmatch(s))
        self.words = [w for _, w in words[:WORD_POOL_SIZE]]
        self._cache: OrderedDict[tuple, _Turn] = OrderedDict()

    # ------------------------------------------------------------------------------------- sampling

    def complete(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        seed: int | None = None,
        temperature: float | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        include_stop_str_in_output: bool = False,
        config: PolicyConfig | None = None,
    ) -> Sampled:
        """Sample one turn for `prompt_ids`, then clip it the way vLLM does (max_tokens, stop strings,
        stop token ids). `temperature == 0` is greedy: the seed no longer matters."""
        config = config or self.config
        effective_seed = 0 if temperature == 0 else (config.seed if seed is None else seed)
        turn = self._turn(prompt_ids, effective_seed, config)
        return self._clip(turn, max_tokens, stop, stop_token_ids, include_stop_str_in_output)

    def _turn(self, prompt_ids: Sequence[int], seed: int, config: PolicyConfig) -> _Turn:
        digest = hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=16)
        digest.update(seed.to_bytes(16, "little", signed=True))
        key = (digest.digest(), config)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        rng = random.Random(digest.digest())
        turn = self._sample(prompt_ids, rng, config)
        self._cache[key] = turn
        if len(self._cache) > COMPLETION_CACHE_SIZE:
            self._cache.popitem(last=False)
        return turn

    def _sample(self, prompt_ids: Sequence[int], rng: random.Random, config: PolicyConfig) -> _Turn:
        # Draw every decision up front, in a fixed order: changing one rate flips only its own choice,
        # so a test can compare the same completion right and wrong.
        correct = rng.random() < config.correct_rate
        think = rng.random() < config.think_rate
        noncanonical = rng.random() < config.noncanonical_rate
        view = self.read_prompt(prompt_ids)
        script = Script(rng=rng, words=self.words, correct=correct, think=think and not view.thinking_closed)
        name, text = scripted_turn(view, script)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        split_at: list[int] = []
        if noncanonical:
            ids, split_at = self._split_one_word(ids, rng)
        ids.append(self.im_end)
        # Plausible logprobs: mostly near zero, a heavy tail; a non-canonical spelling is unlikely.
        logprobs = [-round(rng.random() ** 3 * 4.0 + 1e-4, 6) for _ in ids]
        for i in split_at:
            logprobs[i] = logprobs[i + 1] = -round(6.0 + rng.random() * 3.0, 6)
        return _Turn(ids=ids, logprobs=logprobs, script=name)

    def _split_one_word(self, ids: list[int], rng: random.Random) -> tuple[list[int], list[int]]:
        """Replace one word token by two vocabulary tokens that spell the same bytes. The original ids
        are the canonical encoding of the text, so the result differs from any re-encoding of it."""
        candidates = []
        for pos, token_id in enumerate(ids):
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if piece and _SPLITTABLE.fullmatch(piece):
                splits = [
                    (self._vocab[piece[:k]], self._vocab[piece[k:]])
                    for k in range(1, len(piece))
                    if piece[:k] in self._vocab and piece[k:] in self._vocab
                ]
                if splits:
                    candidates.append((pos, splits))
        if not candidates:
            return ids, []
        pos, splits = rng.choice(candidates)
        first, second = rng.choice(splits)
        return ids[:pos] + [first, second] + ids[pos + 1 :], [pos]

    def _clip(
        self,
        turn: _Turn,
        max_tokens: int,
        stop: Sequence[str],
        stop_token_ids: Sequence[int],
        include_stop_str: bool,
    ) -> Sampled:
        ids, logprobs = turn.ids, turn.logprobs
        limit = min(len(ids), max_tokens)
        finish: Literal["stop", "length"] = "stop" if limit == len(ids) else "length"
        stop_reason: int | str | None = None
        cut_text: str | None = None
        stop_id_set = set(stop_token_ids)
        produced = bytearray()
        for i in range(limit):
            token_id = ids[i]
            if token_id in stop_id_set:
                limit, finish, stop_reason = i + 1, "stop", token_id
                break
            if stop and token_id != self.im_end:
                produced += self.pieces.bytes(token_id)
                text = produced.decode("utf-8", errors="ignore")
                hit = _first_stop(text, stop)
                if hit is not None:
                    at, matched = hit
                    limit, finish, stop_reason = i + 1, "stop", matched
                    cut_text = text[: at + len(matched)] if include_stop_str else text[:at]
                    break
        out_ids = ids[:limit]
        text = cut_text if cut_text is not None else self.tokenizer.decode(out_ids, skip_special_tokens=True)
        return Sampled(out_ids, logprobs[:limit], text, finish, stop_reason, turn.script)

    # ------------------------------------------------------------------------------- prompt reading

    def read_prompt(self, prompt_ids: Sequence[int]) -> PromptView:
        """What the policy needs from a prompt, decoding only its tail and its system message.

        Work is linear in the last message plus the generation prompt, not in the conversation.
        """
        last = _rfind(prompt_ids, self.im_start, len(prompt_ids))
        if last < 0:  # not chat-formatted: treat the whole text as the request
            return PromptView(latest_role="user", latest=self._decode(prompt_ids[-512:]))
        header = self._decode(prompt_ids[last + 1 :])
        if not header.startswith("assistant\n"):
            role, _, body = header.partition("\n")
            return PromptView(latest_role=role, latest=body)
        prev = _rfind(prompt_ids, self.im_start, last)
        role, body = self._message(prompt_ids, prev, last) if prev >= 0 else ("", "")
        view = PromptView(
            latest_role=role,
            latest=body,
            thinking_closed="</think>" in header,
            system=self._system(prompt_ids),
        )
        if view.is_tool_response:
            view.last_user = self._last_user_request(prompt_ids, prev)
        return view

    def _message(self, ids: Sequence[int], start: int, end: int) -> tuple[str, str]:
        text = self._decode(ids[start + 1 : end])
        role, _, body = text.partition("\n")
        return role, body.rstrip("\n").removesuffix("<|im_end|>")

    def _system(self, ids: Sequence[int]) -> str:
        if not ids or ids[0] != self.im_start:
            return ""
        try:
            end = ids.index(self.im_end, 1)
        except ValueError:
            return ""
        role, _, body = self._decode(ids[1:end]).partition("\n")
        return body if role == "system" else ""

    def _last_user_request(self, ids: Sequence[int], before: int) -> str:
        """The latest user message that is not a tool response (only needed after a tool answered).

        Each message on the way back is judged by its first few tokens (role, `<tool_response>`); only the
        one returned is decoded whole. A long agentic trajectory is mostly tool responses: decoding each
        of them on every request made this stand-in's work per call grow with the whole context."""
        end = before
        while end > 0:
            start = _rfind(ids, self.im_start, end)
            if start < 0:
                break
            head_end = min(end, start + 1 + HEAD_TOKENS)
            role, head = self._message(ids, start, head_end)
            if role == "user":
                if head_end < end and len(head) < len(TOOL_RESPONSE) and TOOL_RESPONSE.startswith(head):
                    head = self._message(ids, start, end)[1]  # the head ended inside the marker
                if not head.startswith(TOOL_RESPONSE):
                    return self._message(ids, start, end)[1]
            end = start
        return ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def _rfind(ids: Sequence[int], token_id: int, end: int) -> int:
    """The last index of `token_id` before `end`, or -1. Searched backwards a chunk at a time, in C: the
    cost is the distance searched, not the prompt's length (prompts run to 100k+ ids)."""
    high = end
    while high > 0:
        low = max(0, high - RFIND_CHUNK)
        chunk = list(ids[low:high])
        if token_id in chunk:
            chunk.reverse()
            return high - 1 - chunk.index(token_id)
        high = low
    return -1


def _first_stop(text: str, stop: Sequence[str]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stop:
        at = text.find(s) if s else -1
        if at >= 0 and (best is None or at < best[0]):
            best = (at, s)
    return best
