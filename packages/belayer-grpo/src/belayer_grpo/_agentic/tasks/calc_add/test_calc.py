import unittest

from calc import add, multiply


class TestCalc(unittest.TestCase):
    def test_add(self) -> None:
        assert add(2, 3) == 5
        assert add(-1, 1) == 0

    def test_multiply(self) -> None:
        assert multiply(4, 5) == 20


if __name__ == "__main__":
    unittest.main()
