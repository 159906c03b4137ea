"""The cost of the journal's durability modes (issue 15): none, group commit, fsync per record.

Appends ``--records`` journal operations the size of a preserved prefix (``--tokens`` token ids and
logprobs) through `JournalStore` in each mode, in the same run, on the same disk, and reports the
time per record and records per second.  Results: ``benchmarks/results/bench_journal.json``.

    python benchmarks/bench_journal.py [--records 2000] [--tokens 256] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from belayer_router import JournalStore

RESULTS = Path(__file__).parent / "results"


def one_mode(folder: Path, mode: str, records: int, tokens: int) -> dict[str, Any]:
    store = JournalStore(folder / f"{mode}.jsonl", durability=mode)  # type: ignore[arg-type]
    op = {"op": "prefix", "request_id": "r", "start": 0, "token_ids": list(range(tokens))}
    op["logprobs"] = [-1.25] * tokens
    started = time.perf_counter()
    for _ in range(records):
        store.append(op)
    appended = time.perf_counter() - started
    store.close()
    total = time.perf_counter() - started
    return {
        "mode": mode,
        "records": records,
        "us_per_record": appended / records * 1e6,
        "records_per_s": records / appended,
        "close_s": total - appended,
        "fsyncs": store.num_fsyncs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows = [one_mode(Path(tmp), mode, args.records, args.tokens) for mode in ("none", "group", "fsync")]
    RESULTS.mkdir(exist_ok=True)
    out = {"records": args.records, "tokens_per_record": args.tokens, "rows": rows}
    (RESULTS / "bench_journal.json").write_text(json.dumps(out, indent=2) + "\n")
    print("| durability | us per record | records/s | fsyncs |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['mode']} | {row['us_per_record']:.1f} | {row['records_per_s']:.0f} | {row['fsyncs']} |"
        )


if __name__ == "__main__":
    main()
