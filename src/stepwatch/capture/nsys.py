"""nsys capture ranges: ``torch.cuda.profiler.start()/stop()`` around the captured steps.

Under ``stepwatch run --nsys`` the job runs inside ``nsys profile --capture-range=cudaProfilerApi
--capture-range-end=repeat:N`` (``runner/cli.py``), which records only between
``cudaProfilerStart`` and ``cudaProfilerStop``; the runner sets ``STEPWATCH_NSYS=1`` so the
ranks open those ranges on the same steps as the torch.profiler captures. Without CUDA there is
nothing for nsys to range over: one log line, then nothing.
"""

from __future__ import annotations

import os
from typing import Any

from .._env import NSYS as ENV  # set by `stepwatch run --nsys`, read here only
from .._log import warn_once


def requested(environ: Any = None) -> bool:
    return (environ if environ is not None else os.environ).get(ENV, "") == "1"


class Nsys:
    """Opens and closes one capture range per torch.profiler capture (training thread)."""

    def __init__(self) -> None:
        self.opened = 0

    def _cuda(self) -> Any:
        import torch

        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            warn_once("capture.nsys", "captures: --nsys needs CUDA; no nsys range on this rank")
            return None
        return torch.cuda.profiler

    def start(self) -> None:
        prof = self._cuda()
        if prof is not None:
            prof.start()
            self.opened += 1

    def stop(self) -> None:
        prof = self._cuda()
        if prof is not None and self.opened:
            prof.stop()
