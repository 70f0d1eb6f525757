"""Measure grammar drafting on the default pair: a JSON-schema job, greedy, B=1, four ways on the
same prompts, interleaved (each prompt: every configuration in turn):

  plain        the target alone, constrained (no drafts at all)
  grammar      the target alone + the grammar's forced tokens as drafts
  draft        the int8 draft model, grammar drafting off
  draft+grammar

Every configuration's tokens must equal plain's (greedy is exact under the mask). Usage:

    python scripts/grammar_drafting.py [--prompts 4] [--max-new-tokens 128] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from specbatch.engine import Engine, GenerationParams
from specbatch.engine.grammar import GrammarSpec
from specbatch.engine.loading import load_model

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "occupation", "city", "hobbies", "email"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "occupation": {"type": "string"}, "city": {"type": "string"},
                         "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                         "email": {"type": "string"}}}
TOPICS = ["a retired sailor", "a young violinist", "a baker in Lyon", "a software engineer",
          "a beekeeper", "a marathon runner", "a museum guide", "a chess teacher"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m-int8")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target, draft = load_model(a.target), load_model(a.draft)
    engines = {"plain": Engine(target, [], batch_size=1), "grammar": Engine(target, [], batch_size=1),
               "draft": Engine(target, [draft], batch_size=1),
               "draft+grammar": Engine(target, [draft], batch_size=1)}
    engines["plain"].grammar_drafts = engines["draft"].grammar_drafts = False
    params = GenerationParams(max_new_tokens=a.max_new_tokens, structured=GrammarSpec.json_schema(SCHEMA))
    tokens = dict.fromkeys(engines, 0)
    seconds = dict.fromkeys(engines, 0.0)
    forced = dict.fromkeys(engines, 0)
    mismatches = []
    for topic in TOPICS[: a.prompts]:
        msgs = [{"role": "user", "content": f"Describe {topic} as a JSON object."}]
        ref = None
        for name, eng in engines.items():
            t0 = time.perf_counter()
            out = eng.generate(messages=msgs, params=params)
            seconds[name] += time.perf_counter() - t0
            tokens[name] += len(out.token_ids)
            forced[name] += out.stats.grammar_accepted_tokens
            if ref is None:
                ref = out.token_ids
            elif out.token_ids != ref:
                mismatches.append((topic, name))
    base = tokens["plain"] / seconds["plain"]
    print(f"{a.target} <- {a.draft}, {a.prompts} prompts, {a.max_new_tokens} new tokens max, "
          f"{a.threads} thread(s)")
    print(f"{'config':14} {'tokens':>6} {'tok/s':>7} {'vs plain':>8} {'grammar-drafted share':>22}")
    for name in engines:
        tps = tokens[name] / seconds[name]
        print(f"{name:14} {tokens[name]:6d} {tps:7.1f} {tps / base:7.2f}x {forced[name] / tokens[name]:21.1%}")
    print("token-identical to plain: " + ("yes" if not mismatches else f"NO: {mismatches}"))


if __name__ == "__main__":
    main()
