"""clawray's commands (``clawray ...``, ``python -m clawray.train``) and what only they use;
nothing in the library imports from here."""
