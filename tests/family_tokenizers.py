"""Small offline tokenizers for model families other than Qwen: a byte-level BPE trained here on a few
kilobytes of text, carrying the family's special tokens (the `renderers` library checks them).

Tests cannot download the real tokenizers. What a renderer's bridge, parse and fork paths depend on is
the family's special tokens and a BPE that merges (so a completion can be split non-canonically); both
are here. Each tokenizer is built once per machine and cached under the project cache dir (the same
atomic rename as the bundled one), so a test session pays a few hundred milliseconds at most.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

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


def _build_atomically(target: Path, specials: list[str], bos: str | None, eos: str) -> None:
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        backend = Tokenizer.from_str(_trained_backend_json())
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        fast = PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token=bos, eos_token=eos, clean_up_tokenization_spaces=False
        )
        fast.save_pretrained(str(tmp))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "tokenizer.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
    if (target / "tokenizer.json").exists():
        return str(target)
    source = bundled_tokenizer_dir() if family in ("qwen3", "default") else Path(tokenizer_dir(family))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        for item in source.iterdir():
            if item.is_file():
                shutil.copy(item, tmp / item.name)
        config_path = tmp / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = chat_template
        config_path.write_text(json.dumps(config))
        (tmp / "chat_template.jinja").unlink(missing_ok=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "tokenizer.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
