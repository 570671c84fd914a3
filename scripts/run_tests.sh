#!/usr/bin/env bash
# Runs the test suite and ends with pytest's summary line. Native extensions loaded by the tests
# (triton's bindings) print leak warnings at interpreter exit, after pytest's own summary, so the
# summary is repeated last where CI and people look for it.
set -uo pipefail
log=$(mktemp)
python3 -m pytest "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
echo  # the exit-time warnings may end without a newline
grep -E "^[0-9]+ (passed|failed)|no tests ran" "$log" | tail -n 1
rm -f "$log"
exit "$status"
