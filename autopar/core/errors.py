"""Every error autopar raises on bad input is an ``AutoparError`` subclass.

Each message says what was wrong and what to do about it.
"""


class AutoparError(Exception):
    """Base class of all autopar errors."""


class CaptureError(AutoparError):
    """The model could not be captured with ``torch.export`` (names the op or line)."""


class MeshError(AutoparError):
    """The mesh is not a ``DeviceMesh``/``MeshSpec``, or does not fit the request."""


class InputMismatchError(AutoparError):
    """Example inputs do not match what the model's ``forward`` accepts."""


class InfeasibleError(AutoparError):
    """No plan fits the memory budget; carries the minimum memory that would be needed."""

    def __init__(self, message: str, min_memory_bytes: float | None = None) -> None:
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes


class PlanningTimeout(AutoparError):
    """The solver found no plan at all in the time planning had left (raise ``time_limit``)."""


class PlanFileError(AutoparError):
    """A plan file is malformed, from another autopar version, or from another model/mesh."""


class HardwareError(AutoparError):
    """Unknown hardware preset or malformed hardware description."""


class LossWeightError(AutoparError):
    """``train_step`` cannot find the model's loss, or cannot weigh it exactly over microbatches."""


class BufferWriteError(AutoparError):
    """The forward writes a buffer (running statistics, a counter) in a way this plan cannot keep
    as one device keeps it: names the buffer and what to do."""


class RankFailedError(AutoparError):
    """Another rank failed during ``compile``: carries that rank's number (``rank``) and the first
    line of its error, which that rank prints in full (``autopar.core.together``)."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class CheckpointError(AutoparError):
    """A checkpoint cannot be loaded as asked (none at the path, another model's, no optimizer state)."""
