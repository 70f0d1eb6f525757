"""Measure grammar libraries for structured outputs: compile time and mask time per token.

Not a test, not part of the package: it imports every candidate (llguidance, xgrammar,
outlines-core), which only the measuring machine needs. Usage (numbers in docs/STRUCTURED.md):

    pip install llguidance xgrammar outlines-core
    python scripts/grammar_libs.py --tokenizer /path/to/tokenizer_dir   # or a known model name

For each grammar a valid output is tokenized with the model's tokenizer; each library then
walks those tokens: one mask before each token (timed), then the token is consumed (timed
apart). All on one thread, the way the decode loop would call it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "email": {"type": "string"}}}
ORDER = {"type": "object", "additionalProperties": False,
         "required": ["id", "customer", "items", "status"],
         "properties": {
             "id": {"type": "integer"},
             "customer": {"type": "object", "additionalProperties": False, "required": ["name", "city"],
                          "properties": {"name": {"type": "string"}, "city": {"type": "string"}}},
             "items": {"type": "array", "items": {
                 "type": "object", "additionalProperties": False, "required": ["sku", "qty", "price"],
                 "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"},
                                "price": {"type": "number"}}}},
             "status": {"enum": ["pending", "shipped", "delivered"]}}}
CHOICES = ["positive", "negative", "neutral", "mixed, leaning negative"]
REGEX = r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}Z"

# (name, kind, spec, a valid output)
CASES: list[tuple[str, str, Any, str]] = [
    ("schema:person", "json", PERSON, json.dumps({"name": "Ada Lovelace", "age": 36,
                                                  "email": "ada@example.com"})),
    ("schema:order", "json", ORDER, json.dumps({
        "id": 1042, "customer": {"name": "Grace Hopper", "city": "Arlington"},
        "items": [{"sku": "KB-101", "qty": 2, "price": 49.5}, {"sku": "MS-7", "qty": 1, "price": 19.99},
                  {"sku": "HD-2TB", "qty": 3, "price": 79.0}], "status": "shipped"})),
    ("json_object", "json", {"type": "object"}, json.dumps({
        "title": "Queues and workers", "tags": ["celery", "redis"], "score": 0.93,
        "nested": {"ok": True, "n": None}})),
    ("regex", "regex", REGEX, "2026-12-02T06:30Z"),
    ("choice", "choice", CHOICES, "mixed, leaning negative"),
]


def _stats(ns: list[int]) -> dict[str, float]:
    us = sorted(x / 1e3 for x in ns)
    return {"mean_us": statistics.fmean(us), "median_us": statistics.median(us),
            "p90_us": us[int(0.9 * (len(us) - 1))], "max_us": us[-1]}


def _walk(mask: Callable[[], None], consume: Callable[[int], bool], tokens: list[int]) -> dict[str, Any]:
    mask_ns, adv_ns = [], []
    for t in tokens:
        t0 = time.perf_counter_ns()
        mask()
        t1 = time.perf_counter_ns()
        ok = consume(t)
        t2 = time.perf_counter_ns()
        if not ok:
            raise RuntimeError(f"token {t} rejected")
        mask_ns.append(t1 - t0)
        adv_ns.append(t2 - t1)
    return {"tokens": len(tokens), "mask": _stats(mask_ns), "advance": _stats(adv_ns)}


def run_llguidance(tok: Any, cases: list[tuple[str, str, Any, list[int]]]) -> dict[str, Any]:
    from importlib.metadata import version

    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok)
    out: dict[str, Any] = {"version": version("llguidance"),
                           "tokenizer_s": time.perf_counter() - t0}
    bitmask = lt.allocate_token_bitmask(1, lltok.vocab_size)
    for name, kind, spec, tokens in cases:
        if kind == "json":
            g = llguidance.LLMatcher.grammar_from_json_schema(spec)
        elif kind == "regex":
            g = llguidance.LLMatcher.grammar_from_regex(spec)
        else:
            g = llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in spec))
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(lltok, g, log_level=0)
        compile_s = time.perf_counter() - t0
        assert not m.is_error(), m.get_error()
        t0 = time.perf_counter()
        ff = m.compute_ff_tokens()
        ff_s = time.perf_counter() - t0
        r = _walk(lambda m=m: lt.fill_next_token_bitmask(m, bitmask, 0), m.consume_token, tokens)
        out[name] = {"compile_s": compile_s, "ff_tokens_at_start": len(ff), "ff_us": ff_s * 1e6, **r}
    return out


def run_xgrammar(tok: Any, cases: list[tuple[str, str, Any, list[int]]]) -> dict[str, Any]:
    from importlib.metadata import version

    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    out: dict[str, Any] = {"version": version("xgrammar"), "tokenizer_s": time.perf_counter() - t0}
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    for name, kind, spec, tokens in cases:
        t0 = time.perf_counter()
        if kind == "json":
            cg = (compiler.compile_builtin_json_grammar() if spec == {"type": "object"}
                  else compiler.compile_json_schema(json.dumps(spec), strict_mode=True))
        elif kind == "regex":
            cg = compiler.compile_regex(spec)
        else:
            cg = compiler.compile_regex("|".join(re.escape(c) for c in spec))
        compile_s = time.perf_counter() - t0
        m = xgr.GrammarMatcher(cg)
        ff = m.find_jump_forward_tokens() if hasattr(m, "find_jump_forward_tokens") else []
        r = _walk(lambda m=m: m.fill_next_token_bitmask(bitmask, 0), m.accept_token, tokens)
        out[name] = {"compile_s": compile_s, "ff_tokens_at_start": len(ff), **r}
    return out


def run_outlines_core(tok: Any, cases: list[tuple[str, str, Any, list[int]]]) -> dict[str, Any]:
    from importlib.metadata import version

    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    t0 = time.perf_counter()
    # byte-level BPE token strings (Ġ for a space) back to their bytes, as outlines does
    decode = {v: k for k, v in bytes_to_unicode().items()}
    eos = tok.eos_token_id
    vmap: dict[bytes, list[int]] = {}
    for s, i in tok.get_vocab().items():
        if i == eos or i in tok.all_special_ids:
            continue
        try:
            b = bytes(decode[c] for c in s)
        except KeyError:
            b = s.encode()
        vmap.setdefault(b, []).append(i)
    vocab = Vocabulary(eos, vmap)
    out: dict[str, Any] = {"version": version("outlines-core"), "tokenizer_s": time.perf_counter() - t0}
    mask = torch.zeros((len(tok) + 31) // 32, dtype=torch.int32)
    for name, kind, spec, tokens in cases:
        if kind == "json":
            rx = build_regex_from_schema(json.dumps(spec))
        elif kind == "regex":
            rx = spec
        else:
            rx = "|".join(re.escape(c) for c in spec)
        t0 = time.perf_counter()
        try:
            index = Index(rx, vocab)
        except Exception as e:  # noqa: BLE001 - a measurement: report and go on
            out[name] = {"error": str(e)[:200]}
            continue
        compile_s = time.perf_counter() - t0
        g = Guide(index)

        def consume(t: int, g: Guide = g) -> bool:
            g.advance(t)
            return True

        r = _walk(lambda g=g: g.write_mask_into(mask.data_ptr(), mask.numel(), 4), consume, tokens)
        out[name] = {"compile_s": compile_s, **r}
    return out


RUNNERS = {"llguidance": run_llguidance, "xgrammar": run_xgrammar, "outlines-core": run_outlines_core}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="smollm2-135m")
    ap.add_argument("--libs", default=",".join(RUNNERS))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from specbatch.engine.loading import load_tokenizer

    tok = load_tokenizer(a.tokenizer)
    cases = [(n, k, s, tok.encode(text, add_special_tokens=False) + [tok.eos_token_id])
             for n, k, s, text in CASES]
    # every library gets the same tokens; the EOS at the end checks the grammar may stop there
    cases = [(n, k, s, t[:-1]) for n, k, s, t in cases]
    results = {lib: RUNNERS[lib](tok, cases) for lib in a.libs.split(",")}
    if a.json:
        print(json.dumps(results, indent=1))
        return
    print(f"tokenizer {a.tokenizer}: vocab {len(tok)}")
    print(f"{'library':14} {'case':14} {'tokens':>6} {'compile ms':>10} {'mask mean us':>12} "
          f"{'mask p90 us':>11} {'mask max us':>11} {'advance us':>10}")
    for lib, res in results.items():
        print(f"{lib:14} {'(tokenizer)':14} {'':>6} {res['tokenizer_s'] * 1e3:10.1f}   version {res['version']}")
        for name, *_ in CASES:
            r = res[name]
            if "error" in r:
                print(f"{lib:14} {name:14} error: {r['error']}")
                continue
            print(f"{lib:14} {name:14} {r['tokens']:6d} {r['compile_s'] * 1e3:10.1f} "
                  f"{r['mask']['mean_us']:12.1f} {r['mask']['p90_us']:11.1f} {r['mask']['max_us']:11.1f} "
                  f"{r['advance']['mean_us']:10.1f}")


if __name__ == "__main__":
    main()
