"""Read a GGUF file once per dequantization, not once per transformers call.

Loading a GGUF model's tokenizer and weights through transformers 5.x parses the file three times
(``gguf.GGUFReader``: for the config, the tokenizer, the tensors; the 49k-token vocabulary of the
default model is read field part by field part, ~2-6 s a parse on a 2-core machine) and builds
gguf-py's ``TensorNameMap`` once per module of the model (397 times for SmolLM2-135M, 10-24 s).
Measured in docs/COMPILE.md, "Worker start-up time". Inside ``parsed_once()`` the calls on this
thread share one reader per file and one name map per (architecture, block count). transformers
only reads both, so the tokenizer and weights it builds are unchanged (tests/engine/test_loading.py
compares them with a plain load).

The wrappers are in ``gguf``'s namespace only while some block is open (any thread; a count under a
lock): outside, ``gguf.GGUFReader`` is gguf-py's class again, so code that subclasses it or patches
it (tests do) sees what it would without this module.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

_local = threading.local()      # .memo: this thread's open block, {key: reader or name map}
_lock = threading.Lock()        # guards _open and the swap of gguf's two names
_open = 0                       # blocks open in the process (all threads)
_saved: dict[str, Any] = {}     # while _open: gguf's own entry points, {name: object}, to put back


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """Within this block (this thread only), each GGUF file is parsed once; nested blocks share."""
    import gguf

    _enter(gguf)
    outer = getattr(_local, "memo", None)
    _local.memo = {} if outer is None else outer
    try:
        yield
    finally:
        _local.memo = outer      # the readers (memory maps) are dropped with the block
        _leave(gguf)


def _enter(gguf: Any) -> None:
    """The first open block wraps gguf-py's two entry points (transformers imports both from ``gguf``
    at each call, so the wrappers are what it gets); other threads' calls pass straight through."""
    global _open
    with _lock:
        if _open == 0:
            reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
            _saved.update(GGUFReader=reader, get_tensor_name_map=name_map)
            gguf.GGUFReader = _memoized(reader, lambda path, mode="r": (
                ("reader", os.path.realpath(path)) if mode == "r" else None))
            gguf.get_tensor_name_map = _memoized(name_map, lambda arch, n_blocks: ("names", arch, n_blocks))
        _open += 1


def _leave(gguf: Any) -> None:
    """The last block to close puts gguf-py's own entry points back (a name someone else replaced
    meanwhile is theirs: left as it is)."""
    global _open
    with _lock:
        _open -= 1
        if _open == 0:
            for name, real in _saved.items():
                if getattr(getattr(gguf, name), "__wrapped__", None) is real:
                    setattr(gguf, name, real)
            _saved.clear()


def _memoized(real: Callable[..., Any], key_of: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        memo: dict[Any, Any] | None = getattr(_local, "memo", None)
        key = key_of(*args, **kwargs) if memo is not None else None
        if memo is None or key is None:
            return real(*args, **kwargs)
        if key not in memo:
            memo[key] = real(*args, **kwargs)
        return memo[key]

    call.__wrapped__ = real       # type: ignore[attr-defined]
    call.__doc__ = real.__doc__
    return call
