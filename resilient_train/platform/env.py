"""What the platform tells each replica about the job: which pools train (and so have a
rank), and where its outputs go (the AIP_* directories under the job's output base)."""

from __future__ import annotations

# The pools whose replicas join the process group: the chief and the workers. The
# parameter servers' and evaluators' pools (workerpool2, workerpool3) have no rank.
TRAINING_POOLS = ("workerpool0", "workerpool1")


def tensorboard_log_dir(output_base: str) -> str:
    """The job's AIP_TENSORBOARD_LOG_DIR: its output base's ``logs/``, as on the platform."""
    return f"{output_base}/logs/"


def output_dirs(output_base: str) -> dict[str, str]:
    """The platform's AIP_* directories under a job's output base (no trailing slash)."""
    return {
        "AIP_MODEL_DIR": f"{output_base}/model/",
        "AIP_CHECKPOINT_DIR": f"{output_base}/checkpoints/",
        "AIP_TENSORBOARD_LOG_DIR": tensorboard_log_dir(output_base),
    }
