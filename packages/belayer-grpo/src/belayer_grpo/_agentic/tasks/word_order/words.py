"""Word utilities."""


def reverse_words(sentence: str) -> str:
    """The words of ``sentence`` in reverse order, separated by single spaces."""
    words = sentence.split()
    return " ".join(words)


def count_words(sentence: str) -> int:
    """How many whitespace-separated words ``sentence`` has."""
    return len(sentence.split())
