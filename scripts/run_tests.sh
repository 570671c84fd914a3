#!/usr/bin/env bash
# Runs the test suite and ends with pytest's summary line. Native extensions loaded by the tests
# (triton's bindings) print leak warnings at interpreter exit, after pytest's own summary, so the
# summary is repeated last where CI and people look for it.
#
# The suite runs in BANYAN_TEST_WORKERS processes (default: one per core, 2 to 8; 0 runs it in this process),
# one test file per worker at a time (--dist loadfile), so a module's server starts once. Most of the suite's
# time is server and engine-core start-ups, single-threaded imports, which is why two workers on two cores
# took 480 s where one took 850-890 s.
set -uo pipefail
log=$(mktemp)
workers=${BANYAN_TEST_WORKERS:-$(python3 -c "import os; print(min(8, max(2, len(os.sched_getaffinity(0)))))")}
python3 -m pytest -n "$workers" --dist loadfile "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
echo  # the exit-time warnings may end without a newline
grep -E "^[0-9]+ (passed|failed)|no tests ran" "$log" | tail -n 1
rm -f "$log"
exit "$status"
