"""Math problems: the generated arithmetic task and dapo-math style files (jsonl or parquet)."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from belayer_grpo._errors import DataError

__all__ = ["Problem", "extract_answer", "generate_arithmetic", "load_math_file", "math_reward"]


@attrs.frozen
class Problem:
    """A prompt with a verifiable answer."""

    problem_id: str
    prompt: str
    answer: str


def generate_arithmetic(
    operations: Sequence[str], min_operand: int, max_operand: int, *, seed: int = 0
) -> list[Problem]:
    """Every ``a<op>b=`` with operands in ``[min_operand, max_operand]``, in a seeded shuffled order."""
    apply = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    problems = []
    for op in operations:
        if op not in apply:
            raise DataError(f"unknown operation {op!r}; use '+', '-' or '*'")
        for a in range(min_operand, max_operand + 1):
            for b in range(min_operand, max_operand + 1):
                problems.append(Problem(f"{a}{op}{b}", f"{a}{op}{b}=", str(apply[op](a, b))))
    random.Random(seed).shuffle(problems)
    return problems


def _prompt_text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence) and value and all(isinstance(m, Mapping) for m in value):
        user = [str(m.get("content", "")) for m in value if m.get("role", "user") == "user"]
        if user:
            return "\n\n".join(user)
    raise DataError(f"{where}: 'prompt' must be a string or a list of chat messages with a user turn")


def _answer_text(record: Mapping[str, Any], where: str) -> str:
    reward_model = record.get("reward_model")
    if isinstance(reward_model, Mapping) and reward_model.get("ground_truth") is not None:
        return str(reward_model["ground_truth"])
    for key in ("answer", "ground_truth", "solution"):
        if record.get(key) is not None:
            return str(record[key])
    raise DataError(
        f"{where}: no answer (looked for reward_model.ground_truth, answer, ground_truth, solution)"
    )


def _records(path: Path) -> Iterable[tuple[str, Any]]:
    if path.suffix == ".jsonl":
        with path.open() as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{number}", json.loads(line)
                except ValueError as error:
                    raise DataError(f"{path}:{number}: not valid JSON: {error}") from error
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as error:
            raise DataError("reading parquet needs pyarrow: pip install 'belayer-grpo[parquet]'") from error
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as error:  # pyarrow raises its own ArrowInvalid and friends
            raise DataError(f"{path}: cannot read parquet: {error}") from error
        for number, row in enumerate(rows):
            yield f"{path}[row {number}]", row
    else:
        raise DataError(f"{path}: use a .jsonl or .parquet file in the dapo-math format")


def load_math_file(path: str | Path) -> list[Problem]:
    """Problems of a dapo-math style file: ``prompt`` (text or chat messages) and the answer."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"no such data file {str(path)!r}")
    problems: list[Problem] = []
    for where, record in _records(path):
        if not isinstance(record, Mapping):
            raise DataError(f"{where}: each record must be an object")
        extra = record.get("extra_info")
        index = extra.get("index") if isinstance(extra, Mapping) else None
        problem_id = str(record.get("id", index if index is not None else len(problems)))
        problems.append(
            Problem(problem_id, _prompt_text(record.get("prompt"), where), _answer_text(record, where))
        )
    if not problems:
        raise DataError(f"{path} holds no problems")
    return problems


_ANSWER_LINE = re.compile(r"Answer\s*:\s*(.+)", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")


def extract_answer(text: str) -> str:
    """The last ``Answer: ...`` line, else the last ``\\boxed{...}``, else the whole text; stripped."""
    lines = _ANSWER_LINE.findall(text)
    if lines:
        return str(lines[-1]).strip().rstrip(".").strip("$ ")
    boxed = _BOXED.findall(text)
    if boxed:
        return str(boxed[-1]).strip()
    return text.strip()


def _normalise(answer: str) -> str:
    answer = answer.strip().replace(" ", "").rstrip(".")
    try:
        number = float(answer)
    except ValueError:
        return answer
    return str(int(number)) if number.is_integer() else str(number)


def math_reward(completion: str, answer: str) -> float:
    """1.0 when the extracted answer equals ``answer`` (numbers compared by value), else 0.0."""
    return 1.0 if _normalise(extract_answer(completion)) == _normalise(answer) else 0.0
