"""The inference process's pulse, in the runtime folder's shared memory: when its event loop last ran, and until
when its work last moved (a batch finished, or nothing was waiting). The supervisor and the HTTP workers read it
to tell a hung inference process (stopped, deadlocked, a GPU kernel that never returns) from a busy one: a loop
that ticks while a model loads for minutes is not a hang, nor is a batch that takes long, within the thresholds.

The clock is CLOCK_MONOTONIC (time.monotonic), the same for every process of the host.
"""
import time
from pathlib import Path

import numpy as np

from .arena import map_or_make

PULSE_S = 0.25  # how often the inference process beats
HEARTBEAT = "heartbeat"  # its file in the runtime folder
_LOOP, _PROGRESS = 0, 1


class Heartbeat:
    """The pulse's file, made (zeroed) by whichever process opens it first: the supervisor, before it starts the
    inference process."""

    def __init__(self, path: Path):
        self.values = map_or_make(path, np.dtype(np.float64), 2)

    def reset(self) -> None:
        """No beat yet: a process starting up (imports, then its first beat) is not silent."""
        self.values[:] = 0.0

    def beat(self, progressed: bool) -> None:
        """The event loop runs; `progressed`: a batch finished since the last beat, or no work is waiting."""
        now = time.monotonic()
        self.values[_LOOP] = now
        if progressed:
            self.values[_PROGRESS] = now

    def silence(self) -> float | None:
        """Seconds since the event loop last ran or, where work waits, since it last moved; None before the first
        beat."""
        loop, progress = self.values
        if not loop:
            return None
        return time.monotonic() - min(loop, progress)
