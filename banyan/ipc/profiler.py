"""The engine core's torch profiler, started and stopped by the server (POST /start_profile, /stop_profile).

Between start and stop torch.profiler records every operator the core process runs (CPU, and CUDA kernels
on a GPU) with their shapes; stop writes one Chrome/Perfetto trace, `banyan-core-<pid>-<time>.pt.trace.json`
(the name TensorBoard's profiler plugin and vLLM's traces use), into the directory the server was given.
Profiling slows every step while it runs; the export at stop pauses the core for as long as it writes.
"""

from __future__ import annotations

import os
import time


class ProfilerStateError(Exception):
    """start while running, or stop while not running."""


class CoreProfiler:
    def __init__(self):
        self._profile = None
        self._directory: str | None = None

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self, directory: str) -> None:
        """Start recording (the directory is made now, so a bad one fails here, not at stop)."""
        if self.running:
            raise ProfilerStateError("the profiler is already running; POST /stop_profile first")
        import torch  # the core has loaded torch already; the server side of this module never needs it

        os.makedirs(directory, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities, record_shapes=True)
        profile.start()
        self._profile, self._directory = profile, directory

    def stop(self) -> str:
        """Stop recording and write the trace; returns its path."""
        if not self.running:
            raise ProfilerStateError("the profiler is not running; POST /start_profile first")
        profile, directory = self._profile, self._directory
        self._profile = self._directory = None
        profile.stop()
        path = os.path.join(directory, f"banyan-core-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}.pt.trace.json")
        profile.export_chrome_trace(path)
        return path
