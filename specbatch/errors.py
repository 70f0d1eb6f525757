"""The exceptions specbatch raises on purpose. Anything else is a bug."""

from __future__ import annotations


class SpecBatchError(Exception):
    """Base class: a message a user can act on, never a stack trace."""


class InputError(SpecBatchError):
    """A request or prompt file is invalid. ``line_no`` is 1-based when known."""

    def __init__(self, message: str, *, path: str | None = None, line_no: int | None = None,
                 field: str | None = None) -> None:
        self.path, self.line_no, self.field, self.reason = path, line_no, field, message
        where = ":".join(str(x) for x in (path, line_no) if x is not None)
        parts = [p for p in (where, field, message) if p]
        super().__init__(": ".join(parts))


class InputErrors(InputError):
    """Several problems of one value as one error (the keys of a batch's metadata: a client told
    only of the first fixed it and met the next). ``field``: the value they share (the API's
    ``param``); the message names each problem's own field, in the order given."""

    def __init__(self, problems: list[tuple[str, str]], field: str) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{f}: {r}" for f, r in problems), field=field)

    def __str__(self) -> str:
        return self.reason


def input_error(problems: list[tuple[str, str]], field: str) -> InputError:
    """One problem as an InputError naming its field; several as InputErrors of ``field``."""
    if len(problems) == 1:
        return InputError(problems[0][1], field=problems[0][0])
    return InputErrors(problems, field)


class IntakeError(SpecBatchError):
    """A prompt file failed validation; ``errors`` lists every InputError found."""

    def __init__(self, errors: list[InputError], total: int | None = None, cap: int = 50) -> None:
        self.errors = errors
        self.total = total if total is not None else len(errors)
        shown = "\n".join(str(e) for e in errors[:cap])
        more = f"\n... and {self.total - cap} more" if self.total > cap else ""
        noun = "error" if self.total == 1 else "errors"
        super().__init__(f"{self.total} {noun}; nothing was written:\n{shown}{more}")


class ModelLoadError(SpecBatchError):
    """A model or tokenizer could not be loaded, or a pair is incompatible."""


class DeviceError(SpecBatchError):
    """An unknown or unavailable device, or an unsupported dtype."""


class RequestError(InputError):
    """A single generation request is invalid (the request's own fault: never retried)."""


class JobNotFound(SpecBatchError):
    """No job with that id."""


class BrokerUnavailable(SpecBatchError):
    """The Celery broker could not be reached."""


class SettingsError(SpecBatchError):
    """A SPECBATCH_* setting has a bad value (one line per bad variable, credentials masked)."""


def one_line(error: BaseException | str) -> str:
    """A driver's message on one line: psycopg's "connection refused" goes on with
    "\\n\\tIs the server running on that host ...?", which printed as a second, indented line."""
    return " ".join(part.strip() for part in str(error).splitlines() if part.strip())


# what to do when the device ran out of memory, the one wording of it (the CLI's error line, run's
# stopped line, an unhealthy worker's reason): the budget (engine/memory.py) is a share of what was
# free once the models loaded, and these lower it; running again as before runs out again
OUT_OF_MEMORY_ADVICE = ("out of device memory: give decoding less with --max-memory (SPECBATCH_MAX_MEMORY; "
                        "default 80% of the GPU memory free after loading) or a smaller --batch-size")


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is torch's out-of-memory error (CUDA's allocator). Imports nothing: a
    command that ran out of device memory imported torch already."""
    import sys

    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return isinstance(oom, type) and isinstance(error, oom)
