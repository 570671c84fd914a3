"""The memory this machine can still give a process here: /proc/meminfo, within every cgroup limit on it.

    available = min( MemAvailable,
                     limit - (usage - inactive file cache)   for each memory limit on this process's cgroup
                                                             and its parents: v2 memory.max / memory.current,
                                                             v1 memory.limit_in_bytes / memory.usage_in_bytes )
    total     = min( MemTotal, every such limit )

A cgroup's usage counts the page cache its reads filled (a checkpoint read once); the inactive part of
it is what the kernel reclaims first under the limit, so it counts as available, as MemAvailable counts
it on the host. Nothing here imports torch: the API server reads it to budget models, an engine core to
size its KV pool (runner/memory.py).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from banyan.config_args import parse_size
from banyan.errors import InvalidParameterError

GiB = 1 << 30
V1_UNLIMITED = 1 << 62
"""cgroup v1 writes 'no limit' as the largest page-aligned 64-bit number; anything this large is none."""
RESERVE_FRACTION = 0.1
"""Of the machine's memory (or its cgroup's limit), kept free of models and KV pools (at least MIN_RESERVE): the
API process and its tokenizers, the page cache a checkpoint is read through, whatever else runs here, and the
slack MemAvailable itself needs (it is an estimate of what can be reclaimed)."""
MIN_RESERVE = 1 * GiB
CPU_KV_ENV = "BANYAN_CPU_KV_CACHE_MEMORY"
"""A size (4GiB): the CPU KV pool when --kv-cache-memory is not given, instead of sizing it from free memory
(test suites, machines shared with other programs)."""


@dataclass(frozen=True)
class HostMemory:
    available: int
    total: int
    limited_by: str  # "MemAvailable", or the cgroup limit file that leaves less

    @property
    def reserve(self) -> int:
        """Bytes to keep free of models and KV pools (see RESERVE_FRACTION)."""
        return max(MIN_RESERVE, int(RESERVE_FRACTION * self.total))

    def describe(self) -> str:
        return f"{self.available / GiB:.2f} GiB available ({self.limited_by}) of {self.total / GiB:.2f} GiB"


@dataclass(frozen=True)
class CgroupLimit:
    file: Path  # the limit's file
    limit: int
    usage: int
    inactive_file: int

    @property
    def headroom(self) -> int:
        return max(0, self.limit - max(0, self.usage - self.inactive_file))


def read_host_memory(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> HostMemory:
    """What this process may still allocate (tests pass directories of their own files)."""
    available, total = _meminfo(proc / "meminfo")
    limited_by = "MemAvailable"
    for cgroup in cgroup_limits(proc / "self" / "cgroup", cgroup_root):
        total = min(total, cgroup.limit)
        if cgroup.headroom < available:
            available, limited_by = cgroup.headroom, f"{cgroup.file} - usage"
    return HostMemory(available, total, limited_by)


def _meminfo(path: Path) -> tuple[int, int]:
    """(MemAvailable, MemTotal) in bytes; without /proc: every physical page, all of them free."""
    try:
        fields = dict(line.split(":", 1) for line in path.read_text().splitlines() if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024, int(fields["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total


def cgroup_limits(self_cgroup: Path, root: Path) -> list[CgroupLimit]:
    """Every memory limit on this process's cgroup and its parents, v2 and v1 (a /proc/self/cgroup line is
    'id:controllers:path'; v2's is '0::path')."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:
            found += _limits_along(root, path, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            found += _limits_along(root / "memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes",
                                   "total_inactive_file")
    return found


def _limits_along(mount: Path, path: str, limit_file: str, usage_file: str, inactive_key: str) -> list[CgroupLimit]:
    """The limits of `path` and of each parent up to the mount. In a container the mount is often the container's
    own cgroup while the path names it from the host: then only the mount's directory exists, and it is the one."""
    parts = Path(path.strip("/")).parts
    found = []
    for depth in range(len(parts), -1, -1):
        directory = mount.joinpath(*parts[:depth])
        limit = _read_int(directory / limit_file)
        if limit is None or limit >= V1_UNLIMITED:
            continue
        found.append(CgroupLimit(directory / limit_file, limit, _read_int(directory / usage_file) or 0,
                                 _stat_field(directory / "memory.stat", inactive_key)))
    return found


def _read_int(path: Path) -> int | None:
    """The number in a cgroup file; None where it is missing or says 'max'."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _stat_field(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cpu_kv_from_env() -> int | None:
    """$BANYAN_CPU_KV_CACHE_MEMORY as bytes (None when unset); a malformed size is an error naming it."""
    text = os.environ.get(CPU_KV_ENV)
    if not text:
        return None
    try:
        return parse_size(text)
    except argparse.ArgumentTypeError as e:
        raise InvalidParameterError(CPU_KV_ENV, str(e)) from None
