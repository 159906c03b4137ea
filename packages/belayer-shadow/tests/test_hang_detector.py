"""Hang detection from heartbeat ages: a loaded machine must not pass for a hung main."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from belayer_shadow._workers._heartbeat import HangDetector


def test_stale_after_seen_fresh_is_a_hang():
    detector = HangDetector(stale_s=0.5, poll_s=0.05)
    assert not detector.is_hung(0.1, now=0.0)
    assert not detector.is_hung(0.4, now=0.05)
    assert detector.is_hung(0.6, now=0.10)


def test_a_promoted_main_that_was_never_seen_fresh_gets_the_hard_bound():
    detector = HangDetector(stale_s=0.5, poll_s=0.05, hard_factor=10)
    # Busy re-filling its cache right after a handover: stale, but never seen fresh yet.
    assert not any(detector.is_hung(age, now=i * 0.05) for i, age in enumerate([1.0, 1.5, 2.0, 4.9]))
    assert detector.is_hung(5.1, now=0.25)  # past 10 x 0.5 s it is a hang all the same


def test_a_late_poll_never_decides():
    detector = HangDetector(stale_s=0.5, poll_s=0.05)
    assert not detector.is_hung(0.1, now=0.0)
    assert not detector.is_hung(0.9, now=1.0)  # the shadow itself slept ~1 s: starvation, not a hang
    assert detector.is_hung(0.95, now=1.05)  # on time now, and still stale: a hang


def test_no_heartbeat_yet_is_not_a_hang():
    detector = HangDetector(stale_s=0.5, poll_s=0.05)
    assert not any(detector.is_hung(None, now=i * 0.05) for i in range(100))


@given(st.lists(st.floats(min_value=0.0, max_value=0.5), min_size=1, max_size=50))
def test_fresh_heartbeats_never_hang(ages):
    detector = HangDetector(stale_s=0.5, poll_s=0.05)
    assert not any(detector.is_hung(age, now=i * 0.05) for i, age in enumerate(ages))
