"""Env runners: ``EnvRunner`` actors play GRPO groups of curriculum tasks through the app's
policy and write their rows to the env buffer (``runner.py``)."""
