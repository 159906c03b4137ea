import unittest

from words import count_words, reverse_words


class TestWords(unittest.TestCase):
    def test_reverse_words(self) -> None:
        assert reverse_words("the quick  fox") == "fox quick the"
        assert reverse_words("") == ""

    def test_count_words(self) -> None:
        assert count_words("a b  c") == 3


if __name__ == "__main__":
    unittest.main()
