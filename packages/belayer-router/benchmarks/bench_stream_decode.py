"""The CPU an OpenAI stream's text costs the router's event loop, against its completion length.

Streams one chat completion of ``--lengths`` tokens, one token per event, through `ChoiceText`
(incremental decoding, vLLM-style prefix/read offsets; stop strings searched in new text only)
and, in the same run, through the previous way: decode the whole completion again at every event
and search all of it for the stop strings and the tool marker.  Same tokenizer (the tests' byte-level
chat tokenizer, a real ``tokenizers`` BPE), same text, same stop strings; both streamed texts are
checked to be equal.  Reports CPU seconds per stream and per token.
Results: ``benchmarks/results/bench_stream_decode.json``.

    python benchmarks/bench_stream_decode.py [--lengths 1000 4000 8000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from belayer_router import ChatTemplateTokenizer, TokenEvent, load_tokenizer
from belayer_router._openai._choices import ChoiceText, cut_at_stop
from belayer_router.testing import write_chat_tokenizer

RESULTS = Path(__file__).parent / "results"
STOP = ("</answer>", "STOP")
MARKER = "<tool_call>"
TEXT = "The quick brown fox ✓ jumps over the lazy dog; 日本 🙂 and then some more words. "


def incremental(tokenizer: ChatTemplateTokenizer, token_ids: list[int]) -> tuple[float, str]:
    choice = ChoiceText(tokenizer, STOP, len(MARKER) - 1, tokenizer.decode_reply)
    sent: list[str] = []
    started = time.process_time()
    for index, token_id in enumerate(token_ids):
        choice.add(TokenEvent(index, token_id, -0.5))
        sent.append(choice.take(choice.streamable(MARKER)))
    return time.process_time() - started, "".join(sent)


def whole_each_event(tokenizer: ChatTemplateTokenizer, token_ids: list[int]) -> tuple[float, str]:
    """The previous way: per event, the whole completion decoded and searched again."""
    hold = max(map(len, (*STOP, MARKER))) - 1
    num_sent = 0
    sent: list[str] = []
    started = time.process_time()
    for end in range(1, len(token_ids) + 1):
        text, _stopped = cut_at_stop(tokenizer.decode_reply(token_ids[:end]), STOP)
        if MARKER in text:
            text = text[: text.index(MARKER)]
        text = text.rstrip("\ufffd")
        ready = text[: max(num_sent, len(text) - hold)]
        sent.append(ready[num_sent:])
        num_sent = len(ready)
    return time.process_time() - started, "".join(sent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 4000, 8000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_stream_decode.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = load_tokenizer(write_chat_tokenizer(folder))
    assert isinstance(tokenizer, ChatTemplateTokenizer)
    rows: list[dict[str, Any]] = []
    for length in args.lengths:
        token_ids = tokenizer.encode(TEXT * (length // 20 + 1))[:length]
        best_new = best_old = float("inf")
        for _ in range(args.rounds):
            new_s, new_text = incremental(tokenizer, token_ids)
            old_s, old_text = whole_each_event(tokenizer, token_ids)
            # The incremental one also streams the held-back tail at the finish; the rest agrees.
            assert old_text.startswith(new_text) or new_text.startswith(old_text), length
            best_new, best_old = min(best_new, new_s), min(best_old, old_s)
        rows.append(
            {
                "tokens": length,
                "incremental_cpu_s": best_new,
                "whole_each_event_cpu_s": best_old,
                "incremental_us_per_token": best_new / length * 1e6,
                "whole_each_event_us_per_token": best_old / length * 1e6,
                "speedup": best_old / best_new,
            }
        )
    lines = [
        "| tokens | incremental CPU s | whole re-decode per event CPU s | us/token incremental | us/token whole | ratio |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['tokens']:,} | {r['incremental_cpu_s']:.3f} | {r['whole_each_event_cpu_s']:.3f} | "
        f"{r['incremental_us_per_token']:.1f} | {r['whole_each_event_us_per_token']:.1f} | {r['speedup']:.0f}x |"
        for r in rows
    ]
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": args.rounds, "rows": rows, "table": lines}, indent=2) + "\n")


if __name__ == "__main__":
    main()
