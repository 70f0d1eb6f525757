"""Decode lanes: several decode loops in one process over the same loaded models.

A lane is a ``Decoder`` (its own rows, caches, autopilot, memory share and prefix store) run on a
thread of its own; the models, their packed weights and the draft models are shared and only read.
On a CPU each lane runs one torch thread (engine/threads.py): the products release the GIL, so
the lanes' layers multiply on separate cores and only their Python is taken in turns.

Exactness does not move: a row's numbers do not depend on the rows beside it (packed Linears and
padded attention are batch-invariant, docs/DESIGN.md), so a row decodes to the same tokens in
whichever lane, beside whichever rows. Requests are dealt to lanes by their token budget, largest
first, each to the lane with the least so far (a request's samples and the requests sharing a
prompt prefix stay in one lane: they prefill once); a lane that runs out asks the caller's
``refill`` for more, as one decoder does.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specbatch.engine.decoder import Decoder, Request
    from specbatch.engine.types import GenerationOutput

_DONE = object()


def deal(groups: Sequence[list[Request]], lanes: int) -> list[list[Request]]:
    """``groups`` (requests that must share a lane) dealt to ``lanes`` lanes: the largest group
    (tokens to generate, then prompt tokens) first, each to the lane with the fewest tokens so far."""
    def weight(group: list[Request]) -> tuple[int, int]:
        return sum(p.max_new_tokens for _, _, p in group), sum(len(ids) for _, ids, _ in group)

    parts: list[list[Request]] = [[] for _ in range(lanes)]
    load = [0] * lanes
    for group in sorted(groups, key=weight, reverse=True):
        k = min(range(lanes), key=lambda j: (load[j], j))
        parts[k].extend(group)
        load[k] += weight(group)[0]
    return parts


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def run_lanes(decoders: Sequence[Decoder], parts: Sequence[list[Request]],
              on_start: Callable[[list[int]], None], forks: Mapping[int, int],
              refill: Callable[[Decoder], Callable[[int], list[Request]]] | None
              ) -> Iterator[tuple[int, GenerationOutput]]:
    """Yield (index, output) as each lane's requests finish, as ``Decoder.run`` does for one.

    ``refill(decoder)``: that lane's refill. The caller's callbacks (``on_start``, the refills)
    run on the lanes' threads one at a time, and never while the caller holds an output (between
    its taking one and asking for the next): its code there and theirs share its state (a
    worker's chunk: the result cache, the requests it claimed), as with one decoder, where they
    run inside its ``next``. None runs once the lanes are halted. A
    lane's error is raised here (the other lanes stop at their next step); so is a stop asked
    through the models' hooks (worker/interrupt.py), which every lane meets. Closing the iterator
    stops every lane at its next step and waits for them."""
    lock = threading.Lock()
    halt = threading.Event()
    results: queue.Queue[object] = queue.Queue()

    def locked(fn: Callable[[int], list[Request]]) -> Callable[[int], list[Request]]:
        def call(room: int) -> list[Request]:
            with lock:      # (halted: the caller is gone, claim nothing more for it)
                return [] if halt.is_set() else fn(room)
        return call

    def started(indices: list[int]) -> None:
        with lock:
            if not halt.is_set():
                on_start(indices)

    def lane(decoder: Decoder, part: list[Request]) -> None:
        own = {i for i, _, _ in part}
        try:
            with torch.inference_mode():     # thread-local: each lane enters it
                for item in decoder.run(part, started, forks={i: j for i, j in forks.items() if i in own},
                                        refill=locked(refill(decoder)) if refill is not None else None,
                                        halt=halt):
                    results.put(item)
        except BaseException as e:   # handed to the caller's thread, which raises it
            results.put(_Failed(e))
        finally:
            results.put(_DONE)

    threads = [threading.Thread(target=lane, args=(d, p), name=f"specbatch-lane-{k}", daemon=True)
               for k, (d, p) in enumerate(zip(decoders, parts))]
    for t in threads:
        t.start()
    try:
        running = len(threads)
        while running:
            item = results.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, _Failed):
                raise item.error
            else:
                with lock:     # held while the caller handles it: no callback beside its code
                    yield item     # type: ignore[misc]
    except KeyboardInterrupt:   # a second Ctrl-C: out at once (the lanes are daemons)
        halt.set()
        raise
    finally:
        if not halt.is_set():
            halt.set()
            for t in threads:
                t.join()
