"""Helpers shared by the tests: fresh interpreters (processes.py) and the
scripts they run (scripts/), autocast steps (autocast_steps.py)."""
