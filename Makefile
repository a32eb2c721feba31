# The two quick-start commands (each sets up .venv first):
#   make demo   - serve the embedded default model and train it live from simulated users
#   make test   - run the test suite
.PHONY: setup demo test bench

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python -m clawray.apps.cli demo --out demo-output

test: setup
	.venv/bin/python -m pytest -q --durations=40

bench: setup
	.venv/bin/python bench/serving.py
