"""Probe (issue 31): compile the element-wise parts of each decoder layer of the default target (its
two RMSNorms, and its MLP with MKL's packed product, engine/packed.py, as an opaque custom op so that
the GEMMs stay packed) and time one target step, eager against partly compiled, interleaved rep by
rep; whether the argmax agrees. Not a test; nothing asserts on a time.

    OMP_NUM_THREADS=1 python scripts/layer_compile_probe.py 1      # torch threads

Measured (docs/COMPILE.md, "Compiling parts of a layer"): 0.89-0.95x, slower: 90 compiled regions a
step each pay dynamo's guards and calls, more than fusing a norm or an MLP saves.
"""
import statistics
import sys
import time

import torch

from specbatch.config import Settings
from specbatch.engine.cache import BatchCache
from specbatch.engine.loading import load_model
from specbatch.engine.packed import PackedLinear

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)


@torch.library.custom_op("specbatch_probe::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    lin = REG[weight.data_ptr()]
    return torch.ops.mkl._mkl_linear(x, lin._packed.tensor, weight, bias, x.numel() // weight.shape[1])


@packed_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


REG: dict[int, PackedLinear] = {}
orig_forward = PackedLinear.forward


def fwd(self, x):
    if torch.compiler.is_compiling():
        return torch.ops.specbatch_probe.packed_linear(x, self.weight, self.bias)
    return orig_forward(self, x)


PackedLinear.forward = fwd
settings = Settings()
t = load_model("smollm2-135m", cache_dir=settings.cache_dir, linears=settings.linears)
for m in t.model.modules():
    if isinstance(m, PackedLinear):
        REG[m.weight.data_ptr()] = m
layers = t.model.model.layers
eager = {}
compiled = {}
for i, layer in enumerate(layers):
    for name in ("mlp", "input_layernorm", "post_attention_layernorm"):
        mod = getattr(layer, name)
        eager[(i, name)] = mod.forward
        compiled[(i, name)] = torch.compile(mod.forward, dynamic=True)


def use(table):
    for (i, name), f in table.items():
        getattr(layers[i], name).forward = f


g = torch.Generator().manual_seed(0)
for rows in (32, 8, 1):
    with torch.inference_mode():
        cache = BatchCache(t, rows)
        cache.forward([torch.randint(100, 40000, (200 - b % 7,), generator=g).tolist() for b in range(rows)],
                      logits_to_keep=1)
        times = {"eager": [], "compiled": []}
        same = True
        t0 = time.perf_counter()
        use(compiled)
        step = [[int(x)] for x in torch.randint(100, 40000, (rows,), generator=g)]
        cache.forward(step, logits_to_keep=1)
        cache.drop_tail([1] * rows)
        print(f"B={rows}: first compiled step {time.perf_counter() - t0:.1f} s", flush=True)
        for rep in range(10):
            step = [[int(x)] for x in torch.randint(100, 40000, (rows,), generator=g)]
            outs = []
            for name, table in (("eager", eager), ("compiled", compiled)) if rep % 2 == 0 else \
                    (("compiled", compiled), ("eager", eager)):
                use(table)
                t1 = time.perf_counter()
                outs.append(cache.forward(step, logits_to_keep=1))
                times[name].append(time.perf_counter() - t1)
                cache.drop_tail([1] * rows)
            same = same and torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))
    e, c = (statistics.median(times[n]) * 1e3 for n in ("eager", "compiled"))
    print(f"B={rows}: eager {e:.1f} ms, partly compiled {c:.1f} ms, ratio {e / c:.2f}x, same argmax {same}", flush=True)
