# The two quick-start commands (each sets up .venv first):
#   make demo   - serve the embedded default model, train it live from simulated users, and
#                 run the same with shuffled feedback as a control
#   make test   - run the test suite
# and, not in CI: make test-long - the tests that start Ray clusters of their own
.PHONY: setup demo test test-long bench

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python -m clawray.apps.cli demo --lockstep --seeds 0 \
		--controls none shuffled_feedback --out demo-output

test: setup
	.venv/bin/python -m pytest -q -m "not own_cluster" --durations=40

# The harnesses that start Ray clusters of their own (~8 min on 2 cores): not in `make test`
# (CI), whose tests share one cluster; run them when changing placement, fault handling or a
# benchmark (README, "Tests").
test-long: setup
	.venv/bin/python -m pytest -q -m own_cluster --durations=20

bench: setup
	.venv/bin/python bench/serving.py
