"""The clocks behind reported figures: stage seconds of the demo/proof, busy fractions of a split layout."""

import time

import pytest

from flashdraft.demo.pipeline import StageClock
from flashdraft.distributed.exchange import BusyClock


def test_a_lap_after_a_restart_counts_from_the_restart():
    """The proof restarts its clock after saving each stage; the next stage's lap must not include
    the stages before it (a drafter's lap would otherwise hold the whole prepare stage)."""
    clock = StageClock()
    time.sleep(0.2)
    clock.restart()
    time.sleep(0.05)
    clock.lap("next")
    assert clock.laps["next"] < 0.15


def test_the_busy_fraction_describes_the_last_items_not_the_start_up(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    clock = BusyClock(window=4)
    clock.add(0.0, 1.0)  # a start-up item, then a long wait for the peer's compile
    for start in (30.0, 31.0, 32.0, 33.0):  # steady state: 0.5 s busy per 1 s item
        clock.add(start, 0.5)
    now[0] = 34.0
    assert clock.fraction() == pytest.approx(0.5)
