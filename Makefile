# The two quick-start commands (each sets up .venv first):
#   make demo   - serve the embedded default model, train it live from simulated users, and
#                 run the same with shuffled feedback as a control
#   make test   - run the test suite
.PHONY: setup demo test bench

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python -m clawray.apps.cli demo --lockstep --seeds 0 \
		--controls none shuffled_feedback --out demo-output

test: setup
	.venv/bin/python -m pytest -q --durations=40

bench: setup
	.venv/bin/python bench/serving.py
