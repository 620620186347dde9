"""resilient-train: PyTorch training that survives restarts, preemptions and crashes."""

__version__ = "0.1.0"
