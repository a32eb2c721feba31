"""clawray: continuous RL for self-hosted agent models, on Ray."""
