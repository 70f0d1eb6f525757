"""Tiny random models saved with ``save_pretrained``, loaded back through the real loading code.

``build_tiny_models(root)`` writes, under ``root``:
  tok/            a small byte-level BPE tokenizer with a chat template
  llama/          Llama-like target
  llama-same/     an exact copy of the target (everything accepted)
  llama-partial/  the target with noise on its weights (partly agrees)
  llama-random/   an unrelated random Llama (almost nothing accepted)
  gpt2/           GPT-2-like target, gpt2-partial/ and gpt2-random/ beside it
It is deterministic (fixed seeds) and idempotent: a finished tree is reused.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

CORPUS = [
    "Write a haiku about queues and workers waiting for their turn.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "Summarise: the meeting moved to Tuesday because the room was booked on Monday.",
    "SELECT id, status FROM jobs WHERE status = 'running' ORDER BY created_at;",
    "Question: what is the capital of France? Answer: Paris is the capital of France.",
    "for i in range(10):\n    print(i * i)\n",
    "Once upon a time there was a little robot who liked to count prime numbers: 2, 3, 5, 7, 11.",
    "user assistant system hello hi thanks please explain why how what when where",
] * 4

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

VOCAB = 384


def build_tokenizer(out: Path, corpus: list[str] | None = None, vocab: int = VOCAB,
                    chat_template: str | None = CHAT_TEMPLATE) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus or CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(out)


def _save(model, tok_dir: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(out)


def without_chat_template(src: Path, out: Path) -> Path:
    """A copy of the saved model ``src`` at ``out`` whose tokenizer has no chat template (a base
    model): a short chat line to it passes intake and the engine refuses that request alone, which
    makes a real per-request failure for job tests."""
    import json

    shutil.copytree(src, out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    return out


def _perturbed(model, scale: float, seed: int):
    import copy

    import torch

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp(min=1e-3))
    return other


def build_tiny_models(root: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    final = Path(root)
    if (final / "DONE").exists():
        return final
    root = final.with_name(f"{final.name}.partial-{os.getpid()}")  # concurrent builders don't collide
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    tok_dir = root / "tok"
    build_tokenizer(tok_dir)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    vocab = len(tok)

    def llama(seed: int):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=512, initializer_range=0.2,
                          eos_token_id=eos, bos_token_id=0, pad_token_id=0,
                          tie_word_embeddings=False)
        return LlamaForCausalLM(cfg).eval()

    def gpt2(seed: int):
        torch.manual_seed(seed)
        cfg = GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                         initializer_range=0.2, eos_token_id=eos, bos_token_id=0, pad_token_id=0)
        return GPT2LMHeadModel(cfg).eval()

    for arch, make in (("llama", llama), ("gpt2", gpt2)):
        target = make(0)
        _save(target, tok_dir, root / arch)
        _save(target, tok_dir, root / f"{arch}-same")
        _save(_perturbed(target, 0.05, seed=1), tok_dir, root / f"{arch}-partial")
        _save(make(7), tok_dir, root / f"{arch}-random")
    (root / "DONE").write_text("ok")
    try:
        root.rename(final)
    except OSError:  # another process finished first
        shutil.rmtree(root, ignore_errors=True)
    return final
