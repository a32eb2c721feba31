"""Experiments: runs that reproduce a paper's result through clawray, not features of it.

``rla_table.py`` runs RLAnything's Table 1 (the policy row, + RM co-training, + environment
adaptation) over seeds and writes ``docs/results/rla_table/``; ``clawray rla-table`` starts it.
These modules sit on the top layer beside ``apps/`` (they drive the whole system as a user's
command would), but they answer a research question, so they are kept apart from what a user
runs to serve, train and check a model (``apps/``: serve, the training job, the demos, status,
samples). Why this split and not a top-level folder: docs/architecture.md, "Experiments".
"""
