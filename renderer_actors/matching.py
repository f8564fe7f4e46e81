"""Linear-time matching: token markers inside a completion, and a message list against recorded turns.

Two jobs, both linear in what is being matched, never a rescan of everything recorded before:

- `find_all` / `find_first`: Knuth-Morris-Pratt over token-id sequences. The parser uses them to find
  markers (`<tool_call>`, `<think>`, ...), which a generic tokenizer may spell with several ids.
- `TurnIndex`: chat-mode callers send whole message histories; the renderer must find which recorded
  turn a history continues (its parent). Each recorded turn is stored under the rolling hash of the
  message prefix it was sampled after, so a lookup hashes the incoming list once, prefix by prefix, and
  probes a dict per prefix: O(len(messages)), whatever the number of recorded turns.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


def failure_table(pattern: Sequence[Hashable]) -> list[int]:
    """KMP failure table: `table[i]` is the length of the longest proper border of `pattern[: i + 1]`."""
    table = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = table[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        table[i] = k
    return table


def _occurrences(text: Sequence[Hashable], pattern: Sequence[Hashable], start: int) -> Iterator[int]:
    """Start indices of every (possibly overlapping) non-empty `pattern` in `text[start:]`, in order."""
    table = failure_table(pattern)
    k = 0
    for i in range(start, len(text)):
        while k and text[i] != pattern[k]:
            k = table[k - 1]
        if text[i] == pattern[k]:
            k += 1
        if k == len(pattern):
            yield i - k + 1
            k = table[k - 1]


def find_all(text: Sequence[Hashable], pattern: Sequence[Hashable], start: int = 0) -> list[int]:
    """Start indices of every (possibly overlapping) occurrence of `pattern` in `text[start:]`."""
    if not pattern:
        return list(range(start, len(text) + 1))
    return list(_occurrences(text, pattern, start))


def find_first(text: Sequence[Hashable], pattern: Sequence[Hashable], start: int = 0) -> int:
    """Index of the first occurrence of `pattern` in `text[start:]`, or -1."""
    if not pattern:
        return start if start <= len(text) else -1
    if len(pattern) == 1:
        # The common case (a marker that is one special token): a plain scan, no table.
        target = pattern[0]
        for i in range(start, len(text)):
            if text[i] == target:
                return i
        return -1
    return next(_occurrences(text, pattern, start), -1)


# ------------------------------------------------------------------------------------ parent turns


def message_digest(message: dict[str, Any]) -> bytes:
    """A stable digest of one message: canonical JSON (sorted keys), so dict order does not matter."""
    text = json.dumps(message, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def prefix_hashes(messages: Sequence[dict[str, Any]]) -> list[bytes]:
    """`out[k]` identifies `messages[:k]` (so `out[0]` is the empty prefix). Rolling: each hash is the
    digest of the previous one and the next message's digest, so computing all of them is linear."""
    out = [b""]
    for message in messages:
        out.append(hashlib.blake2b(out[-1] + message_digest(message), digest_size=16).digest())
    return out


@dataclass
class TurnIndex:
    """Recorded turns by the message prefix they were sampled after.

    Usage::

        index = TurnIndex()
        index.record(messages_before_turn, turn_id="t0")      # after sampling a turn
        parent = index.find_parent(incoming_messages)         # -> ("t0", 3) or None

    A turn sampled after `messages[:n]` is the parent of any history that starts with those `n`
    messages followed by that turn's assistant message. When several recorded turns match, the one with
    the longest prefix wins (the most recent point the history continues from).
    """

    _by_prefix: dict[bytes, str] = field(default_factory=dict)

    def record(self, messages_before: Sequence[dict[str, Any]], turn_id: str) -> None:
        self._by_prefix[prefix_hashes(messages_before)[-1]] = turn_id

    def record_hash(self, prefix_hash: bytes, turn_id: str) -> None:
        """Record with a hash from `prefix_hashes` (a caller that already hashed its history)."""
        self._by_prefix[prefix_hash] = turn_id

    def find_parent(self, messages: Sequence[dict[str, Any]]) -> tuple[str, int] | None:
        """(turn id, number of messages it was sampled after) for the longest recorded prefix of
        `messages` that is followed by at least one more message (the turn's own reply), or None."""
        hashes = prefix_hashes(messages)
        for n in range(len(messages) - 1, -1, -1):
            turn = self._by_prefix.get(hashes[n])
            if turn is not None:
                return turn, n
        return None

    def __len__(self) -> int:
        return len(self._by_prefix)
