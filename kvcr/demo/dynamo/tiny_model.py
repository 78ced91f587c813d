"""A model directory small enough to write on the fly: what Dynamo's frontend needs to serve a model.

The frontend loads the tokenizer and config from ``--model-path``/the worker's model name and
never touches weights, so a word-level tokenizer, a small ``config.json`` and a
``tokenizer_config.json`` with a chat template (the frontend refuses a model without one) are
enough for the OpenAI completions and chat APIs. Words are ``w0``.. ``w{N-1}`` plus the three chat
roles, whitespace separated, so a prompt's token ids are easy to predict: ``w{i}`` is id ``i + 3``.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL = ("<unk>", "<s>", "</s>")
ROLES = ("system:", "user:", "assistant:")
DEFAULT_WORDS = 2000


def word(i: int) -> str:
    return f"w{i}"


def token_id(i: int) -> int:
    """The id of ``word(i)``."""
    return len(SPECIAL) + i


def write_tiny_model(directory: Path, words: int = DEFAULT_WORDS) -> Path:
    """Write the model directory (idempotent) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {text: i for i, text in enumerate([*SPECIAL, *(word(i) for i in range(words)), *ROLES])}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": text,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, text in enumerate(SPECIAL)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "vocab_size": len(vocab),
        "max_position_embeddings": 1 << 16,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 1 << 16,
        # Role words are tokens of their own, so every turn of a conversation is a stable prefix.
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}",
    }
    for name, content in (
        ("tokenizer.json", tokenizer),
        ("config.json", config),
        ("tokenizer_config.json", tokenizer_config),
    ):
        (directory / name).write_text(json.dumps(content))
    return directory
