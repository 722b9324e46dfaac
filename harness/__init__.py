"""harness: a Ray-based parallel harness for RL and eval environments in sandboxes."""

__version__ = "0.1.0"
