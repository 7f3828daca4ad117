"""Tiny offline causal LMs and a character-level tokenizer (tests, examples, benchmarks).

Nothing is downloaded: the tokenizer is built with `tokenizers`, the model from a config with
random weights; both are saved to a directory and loaded back with ``from_pretrained``, exactly
as a hub checkpoint would be.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any, NamedTuple

import torch

from grpo.llm._deps import require

__all__ = ["CHARS", "CHAT_TEMPLATE", "build_tiny_model", "build_tiny_tokenizer", "tiny_eos_token_ids"]

CHARS = string.digits + string.ascii_lowercase + " +-=?:.,<>/#\\{}"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)


def build_tiny_tokenizer(
    directory: str | Path, *, pad_is_eos: bool = False, chat_template: bool = False
) -> Any:
    """A char-level ``PreTrainedTokenizerFast`` (55 tokens) saved to ``directory`` and loaded back.

    ``pad_is_eos=True`` makes the pad token the EOS token (as many chat models ship). The
    vocabulary keeps its ``<pad>`` id (the same 55 ids either way), as a special token that
    decoding with ``skip_special_tokens=True`` drops; `build_tiny_model` makes it a second EOS id
    of the model, so a sampled ``<pad>`` ends the completion (a turn) instead of appearing in its
    text (`tiny_eos_token_ids`).
    """
    tokenizers = require("tokenizers")
    transformers = require("transformers")
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<eos>",
        pad_token="<eos>" if pad_is_eos else "<pad>",
        bos_token="<bos>",
        unk_token="<unk>",
        **({"additional_special_tokens": ["<pad>"]} if pad_is_eos else {}),
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def tiny_eos_token_ids(tokenizer: Any) -> int | list[int]:
    """The model's EOS id(s) for ``tokenizer``: its EOS id, and also the id of ``<pad>`` when the
    vocabulary has that token but the pad token is another one (``pad_is_eos=True``): an
    untrained model samples every id, and a ``<pad>`` it samples then ends the completion like
    the EOS (as chat models ship several end ids, e.g. ``<|im_end|>`` and ``<|endoftext|>``)
    instead of being an ordinary token in its text."""
    eos = int(tokenizer.eos_token_id)
    pad = tokenizer.get_vocab().get("<pad>")
    if pad is None or tokenizer.pad_token == "<pad>" or pad == eos:
        return eos
    return [eos, int(pad)]


class _TinySizes(NamedTuple):
    """The architecture sizes of a `build_tiny_model` model: vocabulary V, hidden width H,
    layers, attention heads, key-value heads (None: heads // 2) and MLP width (None: 2 H);
    the last two apply to llama and qwen2."""

    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int | None
    intermediate: int | None


def build_tiny_model(
    directory: str | Path,
    tokenizer: Any,
    *,
    arch: str = "llama",
    seed: int = 0,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    vocab_size: int | None = None,
    kv_heads: int | None = None,
    intermediate: int | None = None,
) -> Any:
    """A random causal LM (``"llama"``, ``"qwen2"`` or ``"gpt2"`` architecture) saved to
    ``directory`` with ``tokenizer`` and loaded back with ``AutoModelForCausalLM.from_pretrained``
    (float32).

    ``vocab_size`` may exceed the tokenizer's: ids it does not know decode to nothing (a model of
    a real vocabulary's size, e.g. Qwen2's 151,936, for benchmarks). ``kv_heads`` (default
    heads // 2) and ``intermediate`` (default 2 * hidden) apply to llama and qwen2.
    ``build_tiny_model(d, tok, arch="qwen2", hidden=896, layers=24, heads=14, kv_heads=2,
    intermediate=4864, vocab_size=151936)`` has Qwen2-0.5B's architecture (random weights).
    """
    transformers = require("transformers")
    torch.manual_seed(seed)
    v = vocab_size or len(tokenizer)
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tiny_eos_token_ids(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
    }
    sizes = _TinySizes(v, hidden, layers, heads, kv_heads, intermediate)
    model = _random_model(transformers, arch, sizes, ids)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)


def _random_model(transformers: Any, arch: str, sizes: _TinySizes, ids: dict[str, Any]) -> Any:
    """A randomly initialised ``arch`` model of ``sizes`` with the token ids ``ids`` (bos, eos,
    pad) in its config (`build_tiny_model`)."""
    vocab_size, hidden, layers, heads, kv_heads, intermediate = sizes
    if arch in ("llama", "qwen2"):
        config_cls, model_cls = (
            (transformers.LlamaConfig, transformers.LlamaForCausalLM)
            if arch == "llama"
            else (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)
        )
        extra = {"tie_word_embeddings": True} if arch == "qwen2" else {}
        cfg = config_cls(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=intermediate or 2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads or max(1, heads // 2),
            max_position_embeddings=1024,
            **extra,
            **ids,
        )
        return model_cls(cfg)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=vocab_size,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_positions=1024,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **ids,
        )
        return transformers.GPT2LMHeadModel(cfg)
    raise ValueError(f"arch={arch!r}: choose 'llama', 'qwen2' or 'gpt2'.")
