"""`BusyClock`: how long the GPU works on the engine's steps, for the busy share of generation.

A step's GPU work is timed by a pair of CUDA events: the start recorded by the engine right before it launches
the step's first kernel (`launch`, after the host has built the inputs), the end after its last (`stop`), read
once the step has synced with the host (`settle`). The time between steps, when the host reads finished rows
and schedules, and the host's preparation of a step's first forward are not counted. Off CUDA it counts nothing.
"""

from __future__ import annotations

import torch


class BusyClock:
    """Seconds of GPU work over the engine's steps so far (`seconds`)."""

    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"
        self.seconds = 0.0
        self._events: list[torch.cuda.Event] = []

    def launch(self) -> None:
        """The step is about to launch GPU work: start its timing, unless it has started already."""
        if self.enabled and not self._events:
            self._events.append(torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def stop(self) -> None:
        """The step has launched all its GPU work."""
        if self._events:
            self._events.append(torch.cuda.Event(enable_timing=True))
            self._events[1].record()

    def settle(self) -> None:
        """After the step has synced: add its GPU time."""
        if len(self._events) == 2:
            self._events[1].synchronize()
            self.seconds += self._events[0].elapsed_time(self._events[1]) / 1000
        self._events = []
