import unittest

from countdown import countdown


class TestCountdown(unittest.TestCase):
    def test_includes_zero(self) -> None:
        assert countdown(3) == [3, 2, 1, 0]

    def test_zero(self) -> None:
        assert countdown(0) == [0]


if __name__ == "__main__":
    unittest.main()
