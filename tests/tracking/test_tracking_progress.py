"""ProgressBar: disabled off a terminal, shows ETA and the last reward on one."""

from __future__ import annotations

import io

from hybridflow.tracking import ProgressBar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_disabled_when_not_a_tty():
    stream = io.StringIO()
    with ProgressBar(total=5, stream=stream) as bar:
        bar.update(1, {"reward/mean": 0.5})
    assert bar.disabled and stream.getvalue() == ""


def test_shows_steps_eta_and_reward_on_a_terminal():
    stream = _Terminal()
    bar = ProgressBar(total=10, initial=2, stream=stream)
    assert not bar.disabled
    bar.update(3, {"reward/mean": 0.25})
    bar.update(5, {"reward/mean": 0.75})
    bar.close()
    last = stream.getvalue().split("\r")[-1]
    assert "5/10" in last and "reward=0.750" in last and "<" in last  # elapsed<remaining (the ETA)
    assert not ProgressBar(total=3, stream=_Terminal(), disable=False).disabled
    assert ProgressBar(total=3, stream=_Terminal(), disable=True).disabled
