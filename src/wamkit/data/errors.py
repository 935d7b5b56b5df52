"""Dataset errors a user can act on (all `wamkit.core.errors.UserError`: one line, exit code 2 from the CLI)."""

from __future__ import annotations

from wamkit.core.errors import UserError


class DatasetError(UserError):
    """Something is wrong with a dataset (layout, metadata, contents)."""


class DatasetFileError(DatasetError):
    """A dataset file is missing or cannot be read; `path` names it."""

    def __init__(self, path, problem: str | None = None):
        # one argument: an already formatted message (a DataLoader worker's error is rebuilt from its message alone)
        self.path = str(path)
        self.problem = problem
        super().__init__(self.path if problem is None else f"{problem}: {self.path}")


class MissingFileError(DatasetFileError):
    def __init__(self, path, what: str = "dataset file"):
        super().__init__(path, f"missing {what}")


class CorruptFileError(DatasetFileError):
    def __init__(self, path, detail: str = ""):
        super().__init__(path, "corrupt or unreadable file" + (f" ({detail})" if detail else ""))


class FeatureMissingError(DatasetError):
    """A requested feature / camera is not in the dataset."""


class FpsMismatchError(DatasetError):
    """The dataset's fps differs from what the config expects."""


class FrameTimestampError(DatasetError):
    """No decoded video frame lies within the tolerance of the requested timestamp."""
