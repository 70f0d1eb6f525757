"""Plan the configurations, run them interleaved on the same prompts, and compute the report data.

Order of work in ``run_bench``:
1. load the target and every draft model once (or random-weight models of the same shapes);
2. plan the configurations: baselines (target alone, HF assisted per draft and setting, HF prompt
   lookup) and ours (each drafter alone, pools of 1..4, a gamma grid, adaptive gamma);
3. warm every configuration up once, untimed;
4. for each repeat, for each prompt, run every configuration in turn (A B C A B C ...): drift on
   a shared machine hits all configurations alike;
5. check every output against the target's own greedy output, token for token;
6. time the step costs directly (T(k) of the target, T(1) of each draft) and compute the bound;
7. optionally, the throughput mode: all prompts through ``generate_many`` at each batch size.

llama.cpp (``bench/llamacpp.py``) joins both as a baseline where llama-cpp-python is installed and
the target is read from a GGUF file: at B=1 among the interleaved configurations, and at each
batch size of the throughput mode, beside ours plain (the target alone, batched).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specbatch.bench import bound as bnd
from specbatch.bench.costs import CostSampler, CostTable
from specbatch.bench.llamacpp import LlamaCppRunner, open_for_target
from specbatch.bench.llamacpp import summarise as llama_cpp_summary
from specbatch.bench.prompts import BenchPrompt, load_prompts, select
from specbatch.bench.runners import (
    HF_ASSISTED_SETTINGS,
    HF_COMPILED_SETTINGS,
    EngineRunner,
    HFRunner,
    RunOutput,
    first_difference,
)
from specbatch.engine.drafter_specs import DrafterSpec
from specbatch.engine.loading import LoadedModel, load_model

logger = logging.getLogger(__name__)

NGRAM = "ngram"
COMPILED_TARGET = "target[compiled]"
LLAMA_CPP_B1 = "llama.cpp[B=1]"
Progress = Callable[[str, int, int], None]   # (what, done, total)


def _drafter(drafts: dict[str, LoadedModel], name: str) -> LoadedModel | DrafterSpec:
    """A pool member: a loaded draft model by its name, else a drafter spec ("ngram")."""
    return drafts[name] if name in drafts else DrafterSpec.parse(name)


@dataclass(frozen=True)
class BenchOptions:
    target: str = "smollm2-135m"
    drafts: tuple[str, ...] = ("smollm2-135m-int8",)
    ngram: bool = True
    prompts: str = "all"
    num_prompts: int | None = 12               # taken round-robin across categories; None: all
    max_new_tokens: int = 128
    repeats: int = 2
    gamma_grid: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    hf_settings: tuple[str, ...] = ("default", "const3", "const5", "heuristic5")
    prompt_lookup_num_tokens: int = 10
    max_pool: int = 4
    batch_sizes: tuple[int, ...] = ()
    throughput_prompts: int = 32
    device: str = "cpu"
    dtype: str = "float32"
    cache_dir: str | None = None
    linears: str = "auto"                      # how float32 CPU Linears multiply (SPECBATCH_LINEARS)
    random_weights: bool = False
    cost_repeats: int = 7
    quick: bool = False
    compile: str = "off"                       # on: ours through the compiled forward (docs/COMPILE.md)
    llama_cpp: bool = True                     # the llama.cpp baseline, where it is installed

    @classmethod
    def quick_defaults(cls, **overrides: Any) -> BenchOptions:
        """A small subset that finishes in about 2-3 minutes on the default pair (2-core CPU)."""
        base = {"num_prompts": 3, "max_new_tokens": 48, "repeats": 2, "gamma_grid": (2, 4, 6),
                "hf_settings": ("default", "const5"), "cost_repeats": 5, "quick": True}
        base.update(overrides)
        return cls(**base)


@dataclass(frozen=True)
class Config:
    """One way of generating. ``drafters``: model names and/or "ngram" (ours), the draft (HF)."""

    name: str
    kind: str                                   # target | hf-assisted | hf-prompt-lookup | llama-cpp | ours
    group: str                                  # baseline | drafter | pool | gamma
    drafters: tuple[str, ...] = ()
    gamma: int | None = None                    # None: the engine's adaptive control
    adaptive: bool = True
    hf_setting: str | None = None


def short_name(model: str) -> str:
    """A model path's last component (names in tables stay readable); known names unchanged."""
    return model.rstrip("/").rsplit("/", 1)[-1] if "/" in model else model


def plan_configs(opts: BenchOptions, drafters: list[str], llama_cpp: bool = False) -> list[Config]:
    """Baselines first, then ours. ``drafters``: model drafts in order, then "ngram" if on;
    ``llama_cpp``: whether the llama.cpp baseline can run here."""
    models = [d for d in drafters if d != NGRAM]
    sn = short_name
    out = [Config("target", "target", "baseline")]
    if opts.compile == "on":   # the compiled target alone: the reference ours must equal exactly
        out.append(Config(COMPILED_TARGET, "target-compiled", "baseline"))
    for d in models:
        for s in opts.hf_settings:
            out.append(Config(f"hf-assisted[{sn(d)},{s}]", "hf-assisted", "baseline", (d,), hf_setting=s))
    if NGRAM in drafters:
        n = opts.prompt_lookup_num_tokens
        out.append(Config(f"hf-prompt-lookup[{n}]", "hf-prompt-lookup", "baseline", (NGRAM,)))
    if llama_cpp:
        out.append(Config(LLAMA_CPP_B1, "llama-cpp", "baseline"))
    for d in drafters:                                      # each drafter alone (pool of 1)
        out.append(Config(f"ours[{sn(d)}]", "ours", "drafter", (d,)))
    for k in range(2, min(opts.max_pool, len(drafters)) + 1):   # pools of 2..4
        pool = tuple(drafters[:k])
        out.append(Config(f"ours[{'+'.join(map(sn, pool))}]", "ours", "pool", pool))
    if drafters:
        for g in opts.gamma_grid:                           # fixed gamma on the first drafter
            out.append(Config(f"ours[{sn(drafters[0])},gamma={g}]", "ours", "gamma", (drafters[0],),
                              gamma=g, adaptive=False))
    return out


# ---------------------------------------------------------------------------------------------
# models


def _random_like(lm: LoadedModel, seed: int) -> LoadedModel:
    """A model of the same shapes with random weights (speed-only runs); int8 kept if it was."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    dtype = next(p for p in lm.model.parameters()).dtype if not lm.info.get("int8") else torch.float32
    model = AutoModelForCausalLM.from_config(copy.deepcopy(lm.model.config), dtype=dtype)
    model.eval().to(lm.device)
    if lm.info.get("int8"):
        from specbatch.engine.loading import _quantize_int8

        model = _quantize_int8(model, lm.device)
    rnd = copy.copy(lm)
    rnd.model = model
    rnd.info = {**lm.info, "random_weights": True}
    return rnd


def load_models(opts: BenchOptions) -> tuple[LoadedModel, dict[str, LoadedModel]]:
    """The target and each draft model by name; with random weights a self-draft is added."""
    kw: dict[str, Any] = {"device": opts.device, "dtype": opts.dtype, "cache_dir": opts.cache_dir,
                          "linears": opts.linears}
    target = load_model(opts.target, **kw)
    drafts = {d: load_model(d, **kw, loaded=[target]) for d in opts.drafts}
    if opts.random_weights:
        target = _random_like(target, seed=1234)
        drafts = {d: _random_like(lm, seed=1235 + i) for i, (d, lm) in enumerate(drafts.items())}
        # the target's own weights as a draft: acceptance comes from here (shares the module)
        self_draft = copy.copy(target)
        self_draft.name = f"{target.name}-self"
        drafts = {self_draft.name: self_draft, **drafts}
    return target, drafts


# ---------------------------------------------------------------------------------------------
# aggregation


@dataclass
class _Acc:
    """What one configuration produced over all prompts and repeats."""

    tokens: int = 0
    seconds: float = 0.0
    runs: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stats: list[Any] = field(default_factory=list)

    def add(self, out: RunOutput) -> None:
        self.tokens += len(out.tokens)
        self.seconds += out.seconds
        self.runs += 1
        if out.stats is not None:
            self.stats.append(out.stats)


def _acceptance(stats: list[Any]) -> dict[str, Any]:
    steps = sum(s.verify_steps for s in stats)
    drafted = sum(s.drafted_tokens for s in stats)
    accepted = sum(s.accepted_tokens for s in stats)
    width = max((len(s.accepted_per_position) for s in stats), default=0)
    per_pos = []
    for j in range(width):
        vals = [s.accepted_per_position[j] for s in stats if len(s.accepted_per_position) > j]
        per_pos.append(sum(vals) / len(vals))
    wins: dict[str, int] = {}
    for s in stats:
        for k, v in s.pool_wins.items():
            wins[k] = wins.get(k, 0) + v
    return {
        "verify_steps": steps, "drafted_tokens": drafted, "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": (accepted + steps) / steps if steps else None,
        "accepted_per_position": per_pos,
        "draft_tokens_per_step": drafted / steps if steps else 0.0,
        "draft_forwards_per_step": sum(s.draft_forwards for s in stats) / steps if steps else 0.0,
        "pool_wins": wins,
        "speculation_disabled": sum(1 for s in stats if s.speculation_disabled),
        # in-situ costs the engine measured while decoding (cross-check of the micro-measurements)
        "engine_draft_ms_per_forward": 1e3 * sum(s.draft_seconds for s in stats) / max(
            1, sum(s.draft_forwards for s in stats)),
        "engine_verify_ms_per_step": 1e3 * sum(s.verify_seconds for s in stats) / steps if steps else None,
    }


def _verify_size(cfg: Config, acc: dict[str, Any]) -> float:
    """Tokens the target scores per step: gamma + 1 for a fixed chain, else mean depth + 1.

    For a pool the engine reports the depth of the draft tree (its longest chain); the tree may
    hold more nodes than that, so for pools this is a lower estimate of the verify cost.
    """
    if cfg.gamma is not None and len(cfg.drafters) == 1:
        return cfg.gamma + 1.0
    return acc["draft_tokens_per_step"] + 1.0


def bound_for(cfg: Config, acc: dict[str, Any], costs: CostTable) -> dict[str, Any]:
    """Leviathan et al.'s bound from the measured acceptance and the measured step costs.

    Tokens per step: the measured mean acceptance length. Cost of a step, in target steps: draft
    forwards per step x c (mean c of the pool's model drafters; n-gram costs ~0) + T(k) / T(1)
    with k = gamma + 1 for a fixed chain, else the mean draft depth + 1 (interpolated between the
    measured sizes). ``alpha``: the i.i.d. acceptance that gives the measured
    tokens per step at that draft length (single drafters only).
    """
    mal = acc["mean_acceptance_length"]
    if mal is None or acc["draft_tokens_per_step"] <= 0:
        return {"alpha": None, "gamma_mean": 0.0, "c": None, "draft_cost_per_step": 0.0,
                "verify_tokens": 1.0, "verify_cost_ratio": 1.0, "bound": None}
    models = [d for d in cfg.drafters if d != NGRAM]
    c = sum(costs.c(d) for d in models) / len(models) if models else 0.0
    draft_cost = acc["draft_forwards_per_step"] * c
    k = _verify_size(cfg, acc)
    ratio = costs.verify_ratio(k)
    depth = k - 1.0
    alpha = bnd.fit_alpha(mal, depth) if len(cfg.drafters) == 1 else None
    return {"alpha": alpha, "gamma_mean": depth, "c": c, "draft_cost_per_step": draft_cost,
            "verify_tokens": k, "verify_cost_ratio": ratio,
            "bound": bnd.bound_from_measurements(mal, draft_cost, ratio)}


# ---------------------------------------------------------------------------------------------
# the run


def _encode(encoder: Any, p: BenchPrompt) -> list[int]:
    tok = encoder.target.tokenizer
    if getattr(tok, "chat_template", None):
        return encoder.encode(messages=p.as_messages())
    text = p.prompt if p.prompt is not None else "\n".join(m["content"] for m in p.messages or ())
    return encoder.encode(prompt=text)


def _build_runners(configs: list[Config], target: LoadedModel, drafts: dict[str, LoadedModel],
                   opts: BenchOptions, llama: LlamaCppRunner | None = None
                   ) -> tuple[dict[str, Any], dict[tuple[str, ...], Any]]:
    from specbatch.engine import Engine

    runners: dict[str, Any] = {}
    engines: dict[tuple[str, ...], Any] = {}
    for cfg in configs:
        if cfg.kind == "target":
            runners[cfg.name] = HFRunner(target)
        elif cfg.kind == "target-compiled":
            engines[cfg.name] = Engine(target)   # no drafter: plain decoding through target.forward
            runners[cfg.name] = EngineRunner(engines[cfg.name], gamma=0, adaptive=False)
        elif cfg.kind == "hf-assisted":
            runners[cfg.name] = HFRunner(target, drafts[cfg.drafters[0]],
                                         HF_ASSISTED_SETTINGS[cfg.hf_setting or "default"],
                                         compiled=cfg.hf_setting in HF_COMPILED_SETTINGS)
        elif cfg.kind == "hf-prompt-lookup":
            runners[cfg.name] = HFRunner(target, prompt_lookup_num_tokens=opts.prompt_lookup_num_tokens)
        elif cfg.kind == "llama-cpp":
            runners[cfg.name] = llama
        else:
            if cfg.name not in engines:  # one engine per configuration: its cost model is its own
                engines[cfg.name] = Engine(target, [_drafter(drafts, d) for d in cfg.drafters])
            runners[cfg.name] = EngineRunner(engines[cfg.name], gamma=cfg.gamma, adaptive=cfg.adaptive)
    return runners, engines


def run_bench(opts: BenchOptions, progress: Progress | None = None,
              notify: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run everything; returns the JSON-able result (``configs``, ``costs``, ``throughput``, ...).
    ``notify`` hears, once, why ``compile="auto"`` decodes eagerly (a CLI prints it)."""
    from specbatch.engine import Engine

    say = progress or (lambda what, done, total: None)
    t_start = time.perf_counter()
    say("loading models", 0, 1)
    target, drafts = load_models(opts)
    compile_plan = None
    if opts.compile == "auto":   # a bench is short: compile only when the on-disk cache holds it
        from specbatch.config import get_settings
        from specbatch.engine.compile.record import is_cached

        cache_dir = opts.cache_dir or get_settings().cache_dir
        # either variant: frozen, or not frozen (where frozen did not fit, or measured no faster)
        hit = all(is_cached(m, cache_dir) or is_cached(m, cache_dir, frozen=False)
                  for m in [target, *drafts.values()] if m.compiled is None and not m.info.get("int8"))
        opts = dataclasses.replace(opts, compile="on" if hit else "off")
        if not hit and notify is not None:
            notify("decoding eagerly: the compile cache does not hold these models' "
                   "graphs; --compile on compiles anyway")
    if opts.compile == "on":
        from specbatch.config import get_settings
        from specbatch.engine.compile.inductor import use_cache_dir
        from specbatch.engine.compile.prepare import prepare

        say("compiling the forward (minutes on a small CPU)", 0, 1)
        cache_dir = opts.cache_dir or get_settings().cache_dir
        use_cache_dir(cache_dir)   # kernels and autotuning shared with later starts
        compile_plan = prepare(target, list(drafts.values()), mode="on",
                               batch_size=max(opts.batch_sizes, default=1), cache_dir=cache_dir)
    drafter_names = list(drafts) + ([NGRAM] if opts.ngram else [])
    llama, llama_info = _open_llama_cpp(opts, target)
    configs = plan_configs(opts, drafter_names, llama_cpp=llama is not None)
    encoder = Engine(target)
    prompts = select(load_prompts(opts.prompts), opts.num_prompts)
    ids = [_encode(encoder, p) for p in prompts]
    runners, _ = _build_runners(configs, target, drafts, opts, llama)
    n = opts.max_new_tokens

    # warm-up: one short untimed run per configuration (first-call allocations, lazy imports);
    # HF's compiled path compiles per prompt's cache size: every prompt, in full
    for i, cfg in enumerate(configs):
        say(f"warm-up {cfg.name}", i, len(configs))
        runner = runners[cfg.name]
        compiles = getattr(runner, "compiles", False)
        for x in ids if compiles else ids[:1]:
            runner(x, n if compiles else min(8, n))

    # step costs are sampled between rounds, so they see the same load as the runs
    k_max = max([g + 1 for g in opts.gamma_grid] + [5])
    prefix = (ids[0] + [t for x in ids for t in x])[: len(ids[0]) + n // 2]
    sampler = CostSampler(target.model, {name: lm.model for name, lm in drafts.items()}, target.device,
                          prefix, range(1, k_max + 1),
                          compiled_target=target if target.compiled is not None else None)
    sampler.sample()   # warm-up of the timers (discarded)
    sampler.samples = {key: [] for key in sampler.samples}

    # interleaved timed runs: for each repeat, for each prompt, every configuration in turn
    accs = {cfg.name: _Acc() for cfg in configs}
    reference: list[list[int] | None] = [None] * len(prompts)
    compiled_ref: list[list[int] | None] = [None] * len(prompts)   # ours run through it
    total, done = opts.repeats * len(prompts) * len(configs), 0
    for r in range(opts.repeats):
        for pi, prompt_ids in enumerate(ids):
            for cfg in configs:
                say(f"repeat {r + 1}/{opts.repeats} prompt {prompts[pi].id} {cfg.name}", done, total)
                acc = accs[cfg.name]
                try:
                    out = runners[cfg.name](prompt_ids, n)
                except Exception as e:  # noqa: BLE001 - a crash is a failure of that config
                    logger.exception("config %s failed on %s", cfg.name, prompts[pi].id)
                    acc.errors.append(f"{prompts[pi].id}: {type(e).__name__}: {e}")
                    done += 1
                    continue
                if cfg.kind == "target" and reference[pi] is None:
                    reference[pi] = out.tokens
                if cfg.kind == "target-compiled" and compiled_ref[pi] is None:
                    compiled_ref[pi] = out.tokens
                ref = compiled_ref[pi] if cfg.kind == "ours" and compiled_ref[pi] is not None \
                    else reference[pi]
                if ref is not None and out.tokens != ref:
                    acc.mismatches.append({"prompt": prompts[pi].id, "repeat": r,
                                           "first_difference": first_difference(out.tokens, ref),
                                           "tokens": len(out.tokens), "reference_tokens": len(ref)})
                acc.add(out)
                done += 1
            sampler.sample()

    say("measuring step costs", 0, 1)
    sampler.sample(max(0, opts.cost_repeats - opts.repeats * len(prompts)))   # at least cost_repeats
    costs = sampler.table()

    result_configs = _summarise(configs, accs, costs)
    try:
        throughput = (_throughput(opts, target, drafts, drafter_names, encoder, load_prompts(opts.prompts),
                                  say, llama) if opts.batch_sizes else None)
    finally:
        if llama is not None:
            llama.close()
    failures = [f"{c['name']}: {m['prompt']} differs from the target at token {m['first_difference']}"
                for c in result_configs if c["kind"] == "ours" for m in c["mismatches"]]
    failures += [f"{c['name']}: {e}" for c in result_configs for e in c["errors"]]
    if throughput:
        failures += [f"throughput B={t['batch_size']} {t['mode']}: {m}" for t in throughput
                     if t["mode"] == "speculative" for m in t["mismatches"]]
    # llama.cpp's differences are its numerics (Q4_1 blocks vs their fp32 dequantization): summarised
    # in the llama_cpp section, not warned of one by one
    warnings = [f"{c['name']} (baseline): {m['prompt']} differs from the target at token "
                f"{m['first_difference']}" for c in result_configs if c["kind"] not in ("ours", "llama-cpp")
                for m in c["mismatches"]]
    if throughput:
        warnings += [f"throughput B={t['batch_size']} target (HF padded batch): {m}"
                     for t in throughput if t["mode"] == "target" for m in t["mismatches"]]
        warnings += [f"throughput B={t['batch_size']} plain compiled vs the eager target (near-tie): {m}"
                     for t in throughput if t["mode"] == "plain" for m in t["mismatches"]]
        warnings += [f"throughput B={t['batch_size']} plain eager batch vs the target alone (near-tie): {m}"
                     for t in throughput if t["mode"] == "plain-eager" for m in t["mismatches"]]
    return {
        "target": target.name, "drafters": drafter_names,
        "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in opts.__dict__.items()},
        "prompts": [{"id": p.id, "category": p.category, "prompt_tokens": len(x)}
                    for p, x in zip(prompts, ids, strict=True)],
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "device": str(target.device), "threads": torch.get_num_threads(),
                        "machine": platform.machine()},
        "costs": costs.to_dict(),
        "compile": _compile_summary(compile_plan, opts),
        "configs": result_configs,
        "throughput": throughput,
        "best_hf_assisted": _best_hf(result_configs),
        "llama_cpp": llama_cpp_summary(llama_info, result_configs, throughput) if opts.llama_cpp else None,
        "failures": failures,
        "warnings": warnings,
        "identical": not failures,
        "seconds": time.perf_counter() - t_start,
    }


def _open_llama_cpp(opts: BenchOptions, target: LoadedModel) -> tuple[LlamaCppRunner | None, dict[str, Any]]:
    """llama.cpp on the target's own GGUF file at this process's torch threads; None and why when
    it cannot run here (not installed: the build line)."""
    if not opts.llama_cpp:
        return None, {"status": "off"}
    return open_for_target(opts.target, opts.cache_dir, target.eos_token_ids, opts.random_weights)


def _compile_summary(plan: Any, opts: BenchOptions) -> dict[str, Any] | None:
    """This start's compile time and whether the on-disk cache held the graphs; the first start's
    time (kept beside the cache) per model."""
    if plan is None:
        return None
    from specbatch.engine.compile.forward import forward_counts

    out: dict[str, Any] = plan.to_dict()
    out["this_start_cached"] = all(r.cached for r in plan.models)
    # a compiled column is only what it says if its steps hit the warmed graphs
    out["forward_calls"] = {m: {"calls": c, "misses": x} for m, (c, x) in forward_counts().items()}
    return out


def _best_hf(configs: list[dict[str, Any]]) -> str | None:
    hf = [c for c in configs if c["kind"] == "hf-assisted" and c["tokens_per_second"]]
    return max(hf, key=lambda c: c["tokens_per_second"])["name"] if hf else None


def _summarise(configs: list[Config], accs: dict[str, _Acc], costs: CostTable) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for cfg in configs:
        a = accs[cfg.name]
        row: dict[str, Any] = {
            "name": cfg.name, "kind": cfg.kind, "group": cfg.group, "drafters": list(cfg.drafters),
            "n_drafters": len(cfg.drafters), "gamma": cfg.gamma, "adaptive": cfg.adaptive,
            "hf_setting": cfg.hf_setting, "runs": a.runs, "new_tokens": a.tokens,
            "seconds": a.seconds,
            "tokens_per_second": a.tokens / a.seconds if a.seconds > 0 else None,
            "identical": not a.mismatches and not a.errors, "mismatches": a.mismatches,
            "errors": a.errors,
        }
        if cfg.kind == "ours" and a.stats:
            acc = _acceptance(a.stats)
            row.update(acc)
            row.update(bound_for(cfg, acc, costs))
        else:
            row.update({"acceptance_rate": None, "mean_acceptance_length": None,
                        "accepted_per_position": [], "alpha": None, "c": None, "bound": None,
                        "gamma_mean": None, "draft_cost_per_step": None,
                        "verify_tokens": None, "verify_cost_ratio": None})
        rows.append(row)
    base = next((r["tokens_per_second"] for r in rows if r["kind"] == "target"), None)
    best = _best_hf(rows)
    best_tps = next((r["tokens_per_second"] for r in rows if r["name"] == best), None)
    for r in rows:
        tps = r["tokens_per_second"]
        r["speedup_vs_target"] = tps / base if tps and base else None
        r["ratio_vs_hf_assisted"] = tps / best_tps if tps and best_tps else None
        r["efficiency"] = bnd.efficiency(r["speedup_vs_target"], r.get("bound"))
    return rows


# ---------------------------------------------------------------------------------------------
# throughput mode


def _throughput(opts: BenchOptions, target: LoadedModel, drafts: dict[str, LoadedModel],
                drafter_names: list[str], encoder: Any, all_prompts: list[BenchPrompt],
                say: Progress, llama: LlamaCppRunner | None = None) -> list[dict[str, Any]]:
    """Total tokens/s over ``throughput_prompts`` prompts at each batch size, ours and target alone.

    Speculative: ``Engine.generate_many(requests, batch_size=B)`` with the first drafter (adaptive).
    Target: Hugging Face ``generate`` on left-padded batches of B. With ``llama``: llama.cpp with B
    sequences in one ``llama_batch``, and ours plain (``generate_many`` of the target alone), what
    the autopilot runs where speculation does not pay. All checked against the target's own
    unbatched greedy output of each prompt (the B=1 target row when there is one).
    """
    from specbatch.engine import Engine

    prompts = [all_prompts[i % len(all_prompts)] for i in range(opts.throughput_prompts)]
    ids = [_encode(encoder, p) for p in prompts]
    n = opts.max_new_tokens
    hf = HFRunner(target)
    first = drafter_names[0] if drafter_names else None
    engine = Engine(target, [_drafter(drafts, first)] if first else [])
    spec = EngineRunner(engine)
    compiled = target.compiled is not None
    # compiled: plain batched decoding through the compiled forward too (ours must equal it
    # exactly), and the same plain decoding eager, interleaved: what compiling buys at each B
    plain = EngineRunner(Engine(target), gamma=0, adaptive=False) if compiled or llama else None
    modes: tuple[str, ...] = ("plain", "plain-eager", "speculative", "target") if compiled else (
        ("speculative", "plain-eager", "target") if llama else ("speculative", "target"))
    modes += ("llama-cpp",) if llama else ()
    order = [(b, mode) for b in opts.batch_sizes for mode in modes]
    plain_outs: dict[int, list[list[int] | Exception]] = {}
    reference: list[list[int]] | None = None
    if 1 in opts.batch_sizes:   # the target at B=1 is the reference: run it first, timed
        order.remove((1, "target"))
        order.insert(0, (1, "target"))
    else:
        say("throughput: reference outputs", 0, 1)
        reference = [hf(x, n).tokens for x in ids]
    spec.batch(ids[:2], min(8, n), batch_size=2)   # warm-up
    rows: list[dict[str, Any]] = []
    for i, (b, mode) in enumerate(order):
        say(f"throughput B={b} {mode}", i, len(order))
        if mode in ("speculative", "plain"):
            runner = spec if mode == "speculative" else plain
            assert runner is not None
            outs, seconds = runner.batch(ids, n, batch_size=b)
            if mode == "plain":
                plain_outs[b] = outs
        elif mode == "llama-cpp":
            assert llama is not None
            try:
                llama_outs, seconds = llama.batch(ids, n, batch_size=b)
                outs = list(llama_outs)
            except RuntimeError as e:   # llama.cpp refused the batch: its row says so, the run goes on
                outs, seconds = [e] * len(ids), 0.0
        elif mode == "plain-eager":
            assert plain is not None
            installed, target.compiled = target.compiled, None
            try:
                outs, seconds = plain.batch(ids, n, batch_size=b)
            finally:
                target.compiled = installed
        else:
            outs, seconds = [], 0.0
            for s in range(0, len(ids), b):
                chunk, sec = hf.batch(ids[s: s + b], n)
                outs.extend(chunk)
                seconds += sec
        if reference is None:
            reference = [o if isinstance(o, list) else [] for o in outs]
        mism: list[str] = []
        diffs: list[int] = []
        tokens = 0
        refs = reference
        if mode == "speculative" and b in plain_outs:   # same forward, same batch size
            refs = [o if isinstance(o, list) else [] for o in plain_outs[b]]
        for p, out, ref in zip(prompts, outs, refs, strict=True):
            if isinstance(out, Exception):
                mism.append(f"{p.id}: {type(out).__name__}: {out}")
                continue
            tokens += len(out)
            if out != ref:
                diffs.append(first_difference(out, ref))
                mism.append(f"{p.id} differs from the target at token {diffs[-1]}")
        rows.append({"batch_size": b, "mode": mode, "prompts": len(ids), "new_tokens": tokens,
                     "seconds": seconds, "tokens_per_second": tokens / seconds if seconds else None,
                     "identical": not mism, "mismatches": mism, "first_differences": sorted(diffs),
                     "drafters": [first] if mode == "speculative" and first else [],
                     "compiled": compiled and mode in ("plain", "speculative")})
    shown = ("speculative", "plain", "plain-eager", "target", "llama-cpp")   # the same order at every B
    rows.sort(key=lambda r: (opts.batch_sizes.index(r["batch_size"]), shown.index(r["mode"])))
    base = {r["mode"]: r["tokens_per_second"] for r in rows if r["batch_size"] == opts.batch_sizes[0]}
    for r in rows:
        b0 = base.get(r["mode"])
        r["vs_first_batch_size"] = r["tokens_per_second"] / b0 if b0 and r["tokens_per_second"] else None
    by_b = {(r["batch_size"], r["mode"]): r["tokens_per_second"] for r in rows}
    for r in rows:
        t = by_b.get((r["batch_size"], "target"))
        r["speedup_vs_target"] = r["tokens_per_second"] / t if t and r["tokens_per_second"] else None
        e = by_b.get((r["batch_size"], "plain-eager"))
        r["vs_plain_eager"] = r["tokens_per_second"] / e if e and r["tokens_per_second"] else None
    return rows
