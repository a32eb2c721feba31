"""Models: the embedded default (built from code) and loading of any local HF causal LM."""
