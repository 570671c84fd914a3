"""How the engine core process starts: run by file path, tied to its server before anything slow.

    python .../banyan/ipc/core_launch.py --parent-pid PID --input ipc://... --output ipc://... ARGS
    python .../banyan/ipc/core_launch.py --worker --parent-pid PID ARGS    (a tensor-parallel worker)

Only the standard library is imported until step 3, because importing banyan takes seconds:

    1. sys.path starts with the directory holding this banyan package, where Python put this file's
       directory; the working directory is never on it. The core runs the server's own code, never a
       `banyan` that happens to sit where the server was started.
    2. from here on, the core exits (status 1, removing the server's socket files) within moments of
       its parent's death: Linux sends PARENT_DEATH_SIGNAL at once (prctl PR_SET_PDEATHSIG), and the
       engine loop compares the parent pid with --parent-pid (the only watch on other systems).
    3. core_process.main() runs: loading, then the engine loop (a worker: runner/worker.main(), its step loop).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import sys

HERE = os.path.dirname(os.path.realpath(__file__))
PACKAGE_ROOT = os.path.dirname(os.path.dirname(HERE))
PARENT_DEATH_SIGNAL = signal.SIGUSR1  # not SIGTERM: the core leaves that one to its server (core_process.main)
_PR_SET_PDEATHSIG = 1


def exit_with_parent(parent_pid: int, on_exit) -> None:
    """From now on, when the parent is no longer `parent_pid`: call on_exit() and exit with status 1."""

    def check(*_) -> None:
        if os.getppid() != parent_pid:  # also sent when only the thread that started us ended: not a death
            try:
                on_exit()
            finally:
                os._exit(1)

    signal.signal(PARENT_DEATH_SIGNAL, check)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0)
    check()  # it may have died before prctl, and then no signal comes


def remove_ipc_files(*addresses: str) -> None:
    """The server died without cleaning up: remove its socket files and their directory if now empty."""
    paths = [a.removeprefix("ipc://") for a in addresses if a.startswith("ipc://")]
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)
    for directory in {os.path.dirname(p) for p in paths}:
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def main() -> int:
    if sys.path and os.path.realpath(sys.path[0] or os.curdir) == HERE:
        sys.path[0] = PACKAGE_ROOT
    else:  # python -P / -I put no script directory first
        sys.path.insert(0, PACKAGE_ROOT)
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--input", default="")
    parser.add_argument("--output", default="")
    parser.add_argument("--fault", default="")
    args, _ = parser.parse_known_args()
    if args.fault == "exit-at-start":  # tests only (engine/faults.py): a core that fails before it is ready
        os.write(2, b"engine-core: injected fault: exiting at start-up\n")
        return 1
    if args.worker:  # the engine core's child: nothing of its own to clean up
        exit_with_parent(args.parent_pid, lambda: None)
        from banyan.runner.worker import main as worker_main

        return worker_main()

    def orphaned() -> None:
        remove_ipc_files(args.input, args.output)
        with contextlib.suppress(OSError):  # stderr is a pipe to the dead server
            os.write(2, b"engine-core: the server process is gone; exiting\n")

    exit_with_parent(args.parent_pid, orphaned)
    from banyan.ipc.core_process import main as core_main

    return core_main()


if __name__ == "__main__":
    sys.exit(main())
