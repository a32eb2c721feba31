"""Training: the ``Trainer`` (a Tune ``Trainable``), SFT and reward-model warm starts, and
held-out evaluation (``evaluate.py``)."""
