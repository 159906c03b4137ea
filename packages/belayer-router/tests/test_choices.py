"""A streamed choice's text (`ChoiceText`): incremental decoding against decoding everything.

Random replies (multi-byte characters, tool markers, stop strings that straddle events), cut into
random events: what is streamed is always a prefix of the whole text, and streamed + the rest at
the finish is exactly the whole text; and the tokens decoded per stream grow linearly, not
quadratically, with its length.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from belayer_router import (
    ByteTokenizer,
    ChatTemplateTokenizer,
    FinishEvent,
    TokenEvent,
    TokensEvent,
    load_tokenizer,
)
from belayer_router._openai._choices import ChoiceText
from belayer_router.testing import write_chat_tokenizer

WORDS = [
    "a",
    "b ",
    "<|im_end|>",
    "STOP",
    "ST",
    "OP",
    "✓",
    "Ünï",
    "日本",
    "🙂",
    "<tool_call>",
    "\n",
    " ",
    "END",
    "x y",
]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplateTokenizer:
    loaded = load_tokenizer(write_chat_tokenizer(tmp_path_factory.mktemp("tok")))
    assert isinstance(loaded, ChatTemplateTokenizer)
    return loaded


def stream(choice: ChoiceText, token_ids: list[int], rng: random.Random, marker: str | None) -> list[str]:
    """Feed ``token_ids`` in random events; the text streamed after each, then at the finish."""
    sent: list[str] = []
    index = 0
    while index < len(token_ids):
        size = rng.choice([1, 1, 1, 2, 3, 7])
        part = token_ids[index : index + size]
        if len(part) == 1:
            choice.add(TokenEvent(index, part[0], -0.5))
        else:
            choice.add(TokensEvent(index, tuple(part), tuple(-0.5 for _ in part)))
        index += len(part)
        streamable = choice.streamable(marker)
        assert choice.text().startswith(streamable)  # never text that a later token takes back
        sent.append(choice.take(streamable))
    choice.add(FinishEvent("r", "stop", 1, len(token_ids), 0))
    sent.append(choice.take(choice.streamable(marker)))
    return sent


@pytest.mark.parametrize("kind", ["bytes", "chat"])
def test_incremental_streaming_text_is_exactly_the_whole_text(
    kind: str, chat_tokenizer: ChatTemplateTokenizer
) -> None:
    rng = random.Random(7)
    byte_tokenizer = ByteTokenizer()
    for _ in range(300):
        text = "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 40)))
        stop = tuple(rng.sample(["STOP", "✓Ü", "END", "OP\n", "本🙂"], rng.randint(0, 2)))
        marker = rng.choice([None, "<tool_call>"])
        if kind == "bytes":
            token_ids = byte_tokenizer.encode(text)
            choice = ChoiceText(byte_tokenizer, stop, 10 if marker else 0)
        else:
            token_ids = chat_tokenizer.encode(text)
            decode = chat_tokenizer.decode_reply
            choice = ChoiceText(chat_tokenizer, stop, 10 if marker else 0, decode)
        streamed = "".join(stream(choice, token_ids, rng, marker))
        whole = choice.text()
        if marker is not None and marker in whole:
            assert streamed == whole[: whole.index(marker)]
        else:
            assert streamed == whole, (text, stop)


def test_a_long_stream_decodes_each_token_a_bounded_number_of_times() -> None:
    decoded: list[int] = []
    tokenizer = ByteTokenizer()

    def counting(token_ids: list[int]) -> str:
        decoded.append(len(token_ids))
        return tokenizer.decode(token_ids)

    decode: Callable[[list[int]], str] = counting
    choice = ChoiceText(tokenizer, ("</answer>",), 10, decode)
    token_ids = tokenizer.encode("The quick brown fox ✓ jumps over the lazy dog. " * 100)
    rng = random.Random(3)
    stream(choice, token_ids, rng, "<tool_call>")
    decoded.clear()  # `stream` also checked every step against a whole decode (`text`)
    choice = ChoiceText(tokenizer, ("</answer>",), 10, decode)
    for index, token_id in enumerate(token_ids):
        choice.add(TokenEvent(index, token_id, -0.5))
        choice.take(choice.streamable("<tool_call>"))
    assert sum(decoded) <= 8 * len(token_ids)  # was len(token_ids)**2 / 2: every event decoded all
