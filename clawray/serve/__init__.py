"""The OpenAI-compatible serving layer (Ray Serve deployments and their pure-Python cores)."""
