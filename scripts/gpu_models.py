"""Random-weight models of the benchmark pair's shapes, saved as model directories, for speed runs
on a machine where the real weights cannot go (docs/bench/report-gpu.md).

    python scripts/gpu_models.py --tokenizer DIR --out DIR [--dtype bfloat16] [--scale 1.0]

writes OUT/qwen2.5-coder-1.5b-shape and OUT/qwen2.5-coder-0.5b-shape: Qwen2 configurations as
Qwen2.5-Coder-1.5B/0.5B-Instruct's GGUF files give them (specbatch/engine/known_models.py names the
files), seeded random weights, and the tokenizer from DIR (both real models share one tokenizer;
save it once from the 0.5B GGUF with ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``).
``--scale`` shrinks every width and depth, for trying this script on a small CPU.

Random weights decode nonsense and a random draft agrees with nothing, so these models measure
costs (T(k)/T(1), the draft's c, batched throughput), not acceptance.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

SHAPES = {   # hidden, intermediate, layers, attention heads (2 key-value heads each), tied head
    "qwen2.5-coder-1.5b-shape": (1536, 8960, 28, 12),
    "qwen2.5-coder-0.5b-shape": (896, 4864, 24, 14),
}


def build(tokenizer: Path, out: Path, dtype: str, scale: float, seed: int = 1234, only: str | None = None,
          device: str = "cpu") -> list[Path]:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    made = []
    for i, (name, (hidden, inter, layers, heads)) in enumerate(SHAPES.items()):
        if only and name != only:
            continue
        head_dim = hidden // heads
        heads_s = max(2, round(heads * scale) // 2 * 2)
        cfg = Qwen2Config(
            vocab_size=151936, hidden_size=head_dim * heads_s, intermediate_size=max(8, int(inter * scale)),
            num_hidden_layers=max(1, round(layers * scale)), num_attention_heads=heads_s,
            num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
            rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
            tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
        torch.manual_seed(seed + i)
        with torch.device(device):   # on a GPU: the random init takes seconds, not 1.5 minutes on its CPU
            model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
        path = out / name
        model.save_pretrained(path)
        for f in tokenizer.iterdir():
            shutil.copy(f, path / f.name)
        made.append(path)
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--device", default="cpu", help="where the random weights are drawn")
    ap.add_argument("--only", choices=sorted(SHAPES), help="build this shape alone")
    a = ap.parse_args()
    for p in build(a.tokenizer, a.out, a.dtype, a.scale, only=a.only, device=a.device):
        print(p)


if __name__ == "__main__":
    main()
