"""llama.cpp as a measured baseline: the same GGUF file the target is read from, decoded greedily
through llama-cpp-python's low-level API, at batch 1 and with several sequences in one
``llama_batch`` (continuous batching: a finished sequence's slot takes the next prompt).

Optional: without llama-cpp-python the baseline is skipped with the line that builds it. The
token ids are ours (the same chat template and tokenizer), so prompts match exactly; greedy is
argmax over ``llama_get_logits_ith``. Its outputs are compared with the target's but never
required to equal them: llama.cpp computes on the Q4_1 blocks, our target on their fp32
dequantization, so near-ties can go the other way.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specbatch.bench.runners import RunOutput

BUILD_LINE = 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36'
N_BATCH = 2048          # tokens per llama_decode (llama.cpp's default logical batch)


def import_llama_cpp() -> tuple[Any, str | None]:
    """(the ``llama_cpp`` module, None), or (None, why not, with the build line)."""
    try:
        import llama_cpp
    except ImportError:
        return None, f"llama-cpp-python is not installed; build it with: {BUILD_LINE}"
    except (OSError, RuntimeError) as e:     # installed, but its shared library does not load
        return None, f"llama-cpp-python does not load ({e}); rebuild it with: {BUILD_LINE}"
    # its import routes llama.cpp's log through Python, printing everything: errors only
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    return llama_cpp, None


Limits = int | Sequence[int]      # new tokens: one limit for every prompt, or one per prompt


def _limits(max_new_tokens: Limits, prompts: Sequence[Sequence[int]]) -> list[int]:
    if isinstance(max_new_tokens, int):
        return [max_new_tokens] * len(prompts)
    return list(max_new_tokens)


def _cells(prompts: Sequence[Sequence[int]], limits: list[int]) -> int:
    """KV cells one sequence needs: the longest prompt plus its new tokens."""
    return max(len(p) + n for p, n in zip(prompts, limits, strict=True))


@dataclass
class _Slot:
    """One sequence of the batch: its llama.cpp seq_id, the tokens still to feed, its output."""

    seq: int
    row: int = -1                       # index of the prompt it decodes; -1: free
    pending: list[int] = field(default_factory=list)
    pos: int = 0                        # position of pending[0]
    out: list[int] = field(default_factory=list)


class LlamaCpp:
    """A loaded GGUF model and a context sized for the batches asked of it. ``lib`` is the
    ``llama_cpp`` module (a fake in unit tests). Not thread-safe; ``close`` frees it."""

    def __init__(self, lib: Any, gguf: Path, threads: int, n_batch: int = N_BATCH) -> None:
        self.lib, self.gguf, self.threads, self.n_batch = lib, gguf, threads, n_batch
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0          # a CPU baseline, like the bench's default device
        # no extra buffer types: with GGML_NATIVE on a CPU that reports AMX, ggml puts the Q4_1
        # weights in its AMX buffer, and ggml_backend_amx_mul_mat crashed (SIGSEGV) on the first
        # decode on the development host; the plain CPU buffer keeps its AVX-512 Q4_1 kernels
        params.use_extra_bufts = False
        self.model = lib.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
        self.ctx: Any = None
        self.shape: tuple[int, int] = (0, 0)            # (sequences, cells per sequence) of ctx
        self.batch = lib.llama_batch_init(n_batch, 0, 1)

    def _context(self, n_seq: int, per_seq: int) -> Any:
        """A context of ``n_seq`` sequences of ``per_seq`` cells each, reused while it fits."""
        if self.ctx is not None and self.shape[0] == n_seq and self.shape[1] >= per_seq:
            return self.ctx
        if self.ctx is not None:
            self.lib.llama_free(self.ctx)
            self.ctx = None
        per_seq = -(-per_seq // 256) * 256
        p = self.lib.llama_context_default_params()
        p.n_ctx, p.n_seq_max, p.n_batch = n_seq * per_seq, n_seq, self.n_batch
        p.n_threads = p.n_threads_batch = self.threads
        # kv_unified stays off (the default): each sequence attends over its own cells only
        self.ctx = self.lib.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {n_seq} x {per_seq} cells")
        self.shape = (n_seq, per_seq)
        return self.ctx

    def prepare(self, prompts: Sequence[Sequence[int]], max_new_tokens: Limits, batch_size: int) -> None:
        """Make the context ``generate`` will use now, outside anything timed."""
        self._context(min(batch_size, len(prompts)), _cells(prompts, _limits(max_new_tokens, prompts)))

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: Limits, batch_size: int,
                 eos: frozenset[int]) -> list[list[int]]:
        """Greedy continuations of every prompt (new tokens, cut before the first EOS, at most
        ``max_new_tokens``: one for all, or one per prompt), up to ``batch_size`` sequences decoding
        together in each ``llama_decode``."""
        lib = self.lib
        limits = _limits(max_new_tokens, prompts)
        ctx = self._context(min(batch_size, len(prompts)), _cells(prompts, limits))
        mem = lib.llama_get_memory(ctx)
        lib.llama_memory_clear(mem, True)
        outs: list[list[int]] = [[] for _ in prompts]
        queue = deque(range(len(prompts)))
        slots = [_Slot(seq=s) for s in range(self.shape[0])]

        def start(slot: _Slot) -> None:       # a free slot takes the next prompt, if any
            lib.llama_memory_seq_rm(mem, slot.seq, -1, -1)
            if queue:
                slot.row = queue.popleft()
                slot.pending, slot.pos, slot.out = list(prompts[slot.row]), 0, outs[slot.row]
            else:
                slot.row = -1

        for slot in slots:
            start(slot)
        while any(s.row >= 0 for s in slots):
            # fill one llama_batch: each slot's pending tokens in turn, up to n_batch
            b = self.batch
            n, ends = 0, []                   # ends: (slot, batch index of its last pending token)
            for slot in slots:
                if slot.row < 0 or n >= self.n_batch:
                    continue
                take = slot.pending[: self.n_batch - n]
                for j, tok in enumerate(take):
                    b.token[n], b.pos[n], b.n_seq_id[n] = tok, slot.pos + j, 1
                    b.seq_id[n][0], b.logits[n] = slot.seq, 0
                    n += 1
                slot.pos += len(take)
                del slot.pending[: len(take)]
                if not slot.pending:          # the slot's last input is in: its logits pick the next
                    b.logits[n - 1] = 1
                    ends.append((slot, n - 1))
            b.n_tokens = n
            rc = lib.llama_decode(ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            for slot, i in ends:
                tok = self._argmax(ctx, i)
                if tok in eos:
                    start(slot)
                    continue
                slot.out.append(tok)
                if len(slot.out) >= limits[slot.row]:
                    start(slot)
                else:
                    slot.pending = [tok]
        return outs

    def _argmax(self, ctx: Any, i: int) -> int:
        import numpy as np

        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(ctx, i), shape=(self.n_vocab,))
        return int(logits.argmax())

    def close(self) -> None:
        lib = self.lib
        if self.batch is not None:
            lib.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx is not None:
            lib.llama_free(self.ctx)
            self.ctx = None
        if self.model is not None:
            lib.llama_model_free(self.model)
            self.model = None


class LlamaCppRunner:
    """The bench's runner interface over ``LlamaCpp``: one prompt (B=1) or all prompts at B."""

    def __init__(self, llama: LlamaCpp, eos: frozenset[int]) -> None:
        self.llama, self.eos = llama, eos

    def __call__(self, ids: list[int], max_new_tokens: int) -> RunOutput:
        self.llama.prepare([ids], max_new_tokens, 1)
        t0 = time.perf_counter()
        out = self.llama.generate([ids], max_new_tokens, 1, self.eos)
        return RunOutput(out[0], time.perf_counter() - t0)

    def batch(self, batch_ids: list[list[int]], max_new_tokens: Limits, batch_size: int
              ) -> tuple[list[list[int]], float]:
        self.llama.prepare(batch_ids, max_new_tokens, batch_size)
        t0 = time.perf_counter()
        outs = self.llama.generate(batch_ids, max_new_tokens, batch_size, self.eos)
        return outs, time.perf_counter() - t0

    def close(self) -> None:
        self.llama.close()


def open_runner(gguf: Path | None, threads: int, eos: frozenset[int], random_weights: bool = False
                ) -> tuple[LlamaCppRunner | None, dict[str, Any]]:
    """The runner, or None and why it is skipped; and what the report says about it."""
    info: dict[str, Any] = {"status": "skipped", "build": BUILD_LINE}
    if random_weights:
        info["reason"] = "--random-weights: llama.cpp would decode the real weights"
        return None, info
    if gguf is None:
        info["reason"] = "the target is not read from a GGUF file, which llama.cpp needs"
        return None, info
    lib, why = import_llama_cpp()
    if lib is None:
        info["reason"] = why
        return None, info
    try:
        llama = LlamaCpp(lib, gguf, threads)
    except (RuntimeError, OSError) as e:
        info["reason"] = f"llama.cpp could not load {gguf}: {e}"
        return None, info
    info.update(status="ran", gguf=str(gguf), threads=threads, n_vocab=llama.n_vocab,
                version=getattr(lib, "__version__", None))
    return LlamaCppRunner(llama, eos), info


def open_for_target(target: str, cache_dir: str | None, eos: frozenset[int], random_weights: bool = False
                    ) -> tuple[LlamaCppRunner | None, dict[str, Any]]:
    """``open_runner`` on the target's own GGUF file (by its name, as the bench loads it) at this
    process's torch threads: the threads ours decode with."""
    import torch

    from specbatch.config import get_settings
    from specbatch.engine.model_files import gguf_path

    gguf = gguf_path(target, cache_dir or get_settings().cache_dir)
    return open_runner(gguf, torch.get_num_threads(), eos, random_weights)


def summarise(info: dict[str, Any], configs: list[dict[str, Any]],
              throughput: list[dict[str, Any]] | None) -> dict[str, Any]:
    """What the report says about llama.cpp: its B=1 tok/s against the target and our best B=1
    configuration, its share of outputs identical to the target's with the first divergences, and
    its best batched throughput against ours (any mode, any B > 1) in the same run."""
    if info.get("status") != "ran":
        return info
    out = dict(info)
    row = next((c for c in configs if c["kind"] == "llama-cpp"), None)
    ours = [c for c in configs if c["kind"] == "ours" and c["tokens_per_second"]]
    best = max(ours, key=lambda c: c["tokens_per_second"], default=None)
    if row is not None and row["tokens_per_second"]:
        tps = row["tokens_per_second"]
        out["b1"] = {"tokens_per_second": tps, "vs_target": row["speedup_vs_target"],
                     "ours_best": best["name"] if best else None,
                     "ours_best_tokens_per_second": best["tokens_per_second"] if best else None,
                     "ours_best_vs_llama_cpp": best["tokens_per_second"] / tps if best else None,
                     "identical": row["runs"] - len(row["mismatches"]), "outputs": row["runs"],
                     "first_divergence": sorted(m["first_difference"] for m in row["mismatches"])}
    rows = [t for t in throughput or [] if t["tokens_per_second"]]
    lrows = [t for t in rows if t["mode"] == "llama-cpp"]
    out["batched"] = [{"batch_size": t["batch_size"], "tokens_per_second": t["tokens_per_second"],
                       "identical": t["prompts"] - len(t["mismatches"]), "outputs": t["prompts"]}
                      for t in lrows]
    lbest = max((t for t in lrows if t["batch_size"] > 1), key=lambda t: t["tokens_per_second"], default=None)
    obest = max((t for t in rows if t["mode"] in ("speculative", "plain", "plain-eager") and t["batch_size"] > 1),
                key=lambda t: t["tokens_per_second"], default=None)
    if lbest is not None:
        out["best_batched"] = {"batch_size": lbest["batch_size"], "tokens_per_second": lbest["tokens_per_second"],
                               "ours_best": f"{obest['mode']}[B={obest['batch_size']}]" if obest else None,
                               "ours_best_tokens_per_second": obest["tokens_per_second"] if obest else None,
                               "ours_best_vs_llama_cpp": obest["tokens_per_second"] / lbest["tokens_per_second"]
                               if obest else None}
    return out
