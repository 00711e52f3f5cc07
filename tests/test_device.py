"""worker/device.py without a GPU: the polled wait behind PN_ASYNC_POLL_US."""
import pytest

from pantheon.worker import device


def test_wait_polled_sleeps_doubling_up_to_the_cap(monkeypatch):
    sleeps = []
    monkeypatch.setattr(device.time, "sleep", sleeps.append)
    answers = iter([False] * 9 + [True])
    assert device.wait_polled(lambda: next(answers), 500) == 10
    assert [round(s * 1e6) for s in sleeps] == [10, 20, 40, 80, 160, 320, 500, 500, 500]


def test_wait_polled_with_no_sleep_only_yields(monkeypatch):
    sleeps = []
    monkeypatch.setattr(device.time, "sleep", sleeps.append)
    answers = iter([False, False, True])
    assert device.wait_polled(lambda: next(answers), 0) == 3
    assert sleeps == [0, 0]


def test_done_at_once_does_not_sleep(monkeypatch):
    monkeypatch.setattr(device.time, "sleep", lambda s: pytest.fail("slept"))
    assert device.wait_polled(lambda: True, 500) == 1


def test_a_die_takes_its_poll_cap_from_the_environment(monkeypatch):
    monkeypatch.setenv("PN_ASYNC_POLL_US", "40")
    assert device.cpu_device().poll_us == 40
    device.cpu_device().settle()                      # nothing queued on a CPU die
