"""`write_chat_tokenizer`: a small local tokenizer folder with a Qwen3-style chat template.

For tests (here and in the packages that drive a router): no hub, no download.  The vocabulary is
the 256 bytes (byte-level, no merges) plus Qwen3's special and tool tokens; the chat template is
written for this folder in Qwen3's layout (``<|im_start|>role ... <|im_end|>``, tools in the
system turn, ``<tool_call>`` JSON in assistant turns, tool results as ``<tool_response>`` in a
user turn).  Built with the ``tokenizers`` library, loaded with transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "TOOL_TOKENS", "write_chat_tokenizer"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")

CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages and messages[0].role == 'system' %}{{ messages[0].content + '\n\n' }}{% endif %}"
    "# Tools\n\nYou may call one or more functions. Their signatures:\n<tools>"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    '{{ \'\n</tools>\n\nFor each call, write a JSON object with "name" and "arguments" between '
    "<tool_call> and </tool_call>.<|im_end|>\n' }}"
    "{% elif messages and messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% if not loop.first %}{{ '<|im_start|>system\n' + message.content + '<|im_end|>\n' }}{% endif %}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message.role + '\n' + (message.content or '') }}"
    "{% if message.role == 'assistant' and message.tool_calls %}"
    "{% for call in message.tool_calls %}"
    "{% set fn = call.function if call.function else call %}"
    "{% if message.content or not loop.first %}{{ '\n' }}{% endif %}"
    '{{ \'<tool_call>\n{"name": "\' + fn.name + \'", "arguments": \' }}'
    "{% if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif %}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_alphabet() -> list[str]:
    """The printable stand-in character of each byte, as byte-level BPE vocabularies spell them."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    alphabet: list[str] = []
    shifted = 0
    for byte in range(256):
        if byte in printable:
            alphabet.append(chr(byte))
        else:
            alphabet.append(chr(256 + shifted))
            shifted += 1
    return alphabet


def write_chat_tokenizer(folder: str | Path) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder``; return the folder.

    Token ids: 0..255 the bytes, then `SPECIAL_TOKENS` (``<|im_end|>`` is the end of a turn and
    the eos token), then `TOOL_TOKENS`.  Needs ``pip install tokenizers``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {char: byte for byte, char in enumerate(_byte_alphabet())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": 32768,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder
