"""One decode forward of the default target against its three floors, at the decode loop's row counts.

    OMP_NUM_THREADS=2 PYTHONPATH=. python scripts/forward_floor.py --threads 2

For each row count, one new token over a 200-column cache (the engine's growing cache, the
packed Linears the engine loads), the median of ``--repeats`` forwards, against:

- **dispatch**: the same architecture at the same depth with tiny widths (hidden 64, vocabulary
  512): what the forward costs when its operators compute next to nothing. Python, transformers'
  modules and torch's per-operator dispatch; what a compiled graph removes (docs/COMPILE.md).
- **weights**: the bytes of every Linear weight (the head included) over the read bandwidth this
  process measures (a sum over a buffer larger than the caches): the least a forward that reads
  every weight once can take. At few rows this, not the GEMMs, is the bound.
- **compute**: 2 x rows x the Linears' parameters over the best GEMM rate
  (``bench.breakdown.gemm_peak_gflops``, the job's row counts): the least the products take.

A forward's time over the larger of the last two is how far it is from its roofline; the
dispatch column is how much of the gap is not arithmetic at all.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch


def forward_ms(model: Any, rows: int, vocab: int, repeats: int) -> float:
    from specbatch.engine.hf_cache import cache_kwarg, new_cache

    kw = cache_kwarg(model)
    with torch.inference_mode():
        cache = new_cache()
        model(input_ids=torch.randint(0, vocab, (rows, 200)), **{kw: cache}, use_cache=True)
        step = torch.randint(0, vocab, (rows, 1))
        times = []
        for _ in range(repeats + 2):
            t0 = time.perf_counter()
            model(input_ids=step, **{kw: cache}, use_cache=True)
            times.append(time.perf_counter() - t0)
            cache.crop(-1)      # back to 200 columns: every forward sees the same cache
    return statistics.median(times[2:]) * 1e3


def read_gbps(nbytes: int, repeats: int = 5) -> float:
    buf = torch.ones(nbytes // 4)
    buf.sum()
    t0 = time.perf_counter()
    for _ in range(repeats):
        buf.sum()
    return nbytes * repeats / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from transformers import AutoConfig, AutoModelForCausalLM

    from specbatch.bench.breakdown import gemm_peak_gflops
    from specbatch.config import Settings
    from specbatch.engine.loading import load_model

    settings = Settings.from_env()
    target = load_model(settings.default_target, device="cpu", dtype="float32",
                        cache_dir=settings.cache_dir or None, linears=settings.linears)
    cfg = target.model.config
    tiny_cfg = AutoConfig.for_model(cfg.model_type, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096)
    tiny = AutoModelForCausalLM.from_config(tiny_cfg).eval()
    linears = [m for m in target.model.modules() if isinstance(m, torch.nn.Linear)]
    params = sum(m.weight.numel() for m in linears)
    gbps = read_gbps(max(4 * params, 1 << 30))
    peak = gemm_peak_gflops(cfg.hidden_size, cfg.intermediate_size, linears=settings.linears)
    print(f"{cfg.num_hidden_layers} layers, {params / 1e6:.0f}M Linear parameters ({4 * params / 1e6:.0f} MB), "
          f"read {gbps:.1f} GB/s, GEMM peak {peak:.0f} GFLOPS, {a.threads} thread(s)")
    print(f"{'rows':>5} {'forward':>9} {'dispatch':>9} {'weights':>9} {'compute':>9} {'fwd/roof':>9}")
    for rows in (int(r) for r in a.rows.split(",")):
        fwd = forward_ms(target.model, rows, target.vocab_size, a.repeats)
        floor = forward_ms(tiny, rows, 512, a.repeats)
        weights = 4 * params / gbps / 1e6
        compute = 2 * rows * params / peak / 1e6
        print(f"{rows:5d} {fwd:8.1f}ms {floor:8.1f}ms {weights:8.1f}ms {compute:8.1f}ms "
              f"{fwd / max(weights, compute):8.2f}x", flush=True)


if __name__ == "__main__":
    main()
