"""The local platform emulator: job state machine, restart policy, worker processes."""
