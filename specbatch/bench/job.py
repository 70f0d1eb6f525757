"""`specbatch bench --job FILE`: a whole prompt file end to end, per configuration, in one process.

Configurations (``plan``):
  ours-auto                 the defaults: ``Engine(batch_size="auto")`` with the draft (autopilot);
  ours[B=b,spec|plain]      ``generate_many`` at a fixed B, with the draft or the target alone;
  hf-generate[B=b]          Hugging Face ``generate`` on left-padded batches of b, greedy;
  hf-assisted[B=1]          Hugging Face assisted generation with the draft, one prompt at a time;
  llama-cpp[B=b]            llama.cpp on the target's GGUF file, b sequences in one llama_batch
                            (bench/llamacpp.py), where llama-cpp-python is installed.
With ``shared_prefix`` (a generated file whose requests share one long system prompt,
bench/shared_prefix.py) the plan is instead: ours-auto with the prefix cache, ours-auto without it
(``ours-auto[no-prefix-cache]``), hf-generate and llama-cpp at each B.
Every configuration decodes every prompt of the file (greedy; each line's max_tokens, or
``--max-new-tokens``) from a fresh engine, so nothing one learned helps another. Repeats run the
configurations in a rotated order (A B C, B C A, ...): drift on a shared machine hits all alike.
tokens/s = new tokens of the whole file / wall seconds of the whole file. Every output is
compared with the target's own unbatched greedy output, token for token (cut at EOS); llama.cpp's
differences are counted, never a failure: it computes on the Q4_1 blocks, the target on their fp32
dequantization.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specbatch.bench import breakdown
from specbatch.bench.llamacpp import LlamaCppRunner, open_for_target
from specbatch.bench.runners import HF_ASSISTED_SETTINGS, HFRunner, cut_at_eos, first_difference, generate_all
from specbatch.engine.loading import LoadedModel
from specbatch.engine.packed import packed_kernel

Progress = Callable[[str, int, int], None]
FULL_SIZES = (1, 4, 8, 16, 32)
QUICK_SIZES = (1, 4, 16)
SHARED_PREFIX_SIZES = (8,)        # hf-generate beside the prefix cache on / off: the CPU's usual best
NO_PREFIX = "ours-auto[no-prefix-cache]"


@dataclass(frozen=True)
class JobBenchOptions:
    file: str
    target: str = "smollm2-135m"
    draft: str = "smollm2-135m-int8"
    batch_sizes: tuple[int, ...] = FULL_SIZES
    max_new_tokens: int | None = None      # None: each line's own
    num_prompts: int | None = None         # None: the whole file
    repeats: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    cache_dir: str | None = None
    quick: bool = False
    shared_prefix: int | None = None       # the generated file's system prompt, tokens (plan above)
    prefix_cache: bool = True              # off: every one of ours prefills whole prompts
    llama_cpp: bool = True                 # llama-cpp[B=b] rows, where llama-cpp-python is installed
    breakdown: bool = True                 # one more ours-auto pass, profiled: where the time goes

    @classmethod
    def quick_defaults(cls, **overrides: Any) -> JobBenchOptions:
        """Under 5 minutes on the default pair on an idle 2-core CPU: 12 prompts, 32 tokens, B in 1,4,16."""
        base: dict[str, Any] = {"batch_sizes": QUICK_SIZES, "max_new_tokens": 32, "num_prompts": 12,
                                "quick": True}
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


@dataclass(frozen=True)
class JobConfig:
    name: str
    kind: str                     # ours | hf-generate | hf-assisted | llama-cpp
    batch_size: int | str         # "auto" for ours-auto
    speculative: bool | str       # "auto": the autopilot decides
    prefix_cache: bool = True     # shared prompt prefixes computed once (engine/prefix.py)


def job_requests(parsed: Sequence[Any], target: LoadedModel) -> list[tuple[list[int], int]]:
    """(prompt ids, max new tokens) per line of a job file as intake parsed it
    (``intake.parse_file``), with the target's tokenizer and chat template."""
    from specbatch.engine import Engine

    enc = Engine(target)
    return [(enc.encode(p.prompt, p.messages), p.generation_params().max_new_tokens) for p in parsed]


def plan(sizes: tuple[int, ...], shared_prefix: bool = False, prefix_cache: bool = True,
         llama_cpp: bool = False) -> list[JobConfig]:
    """``llama_cpp``: whether llama.cpp can run here (its rows follow HF generate's at each B)."""
    def llama(b: int) -> list[JobConfig]:
        return [JobConfig(f"llama-cpp[B={b}]", "llama-cpp", b, False, False)] if llama_cpp else []

    if shared_prefix:
        return [JobConfig("ours-auto", "ours", "auto", "auto"),
                JobConfig(NO_PREFIX, "ours", "auto", "auto", prefix_cache=False),
                *(c for b in sizes for c in [JobConfig(f"hf-generate[B={b}]", "hf-generate", b, False),
                                             *llama(b)])]
    out = [JobConfig("ours-auto", "ours", "auto", "auto", prefix_cache)]
    for b in sizes:
        out.append(JobConfig(f"ours[B={b},spec]", "ours", b, True, prefix_cache))
        out.append(JobConfig(f"ours[B={b},plain]", "ours", b, False, prefix_cache))
        out.append(JobConfig(f"hf-generate[B={b}]", "hf-generate", b, False))
        out.extend(llama(b))
    if 1 in sizes:   # (--batch-sizes without 1 narrows B=1 away, assisted generation included)
        out.append(JobConfig("hf-assisted[B=1]", "hf-assisted", 1, True))
    return out


def _ours(target: LoadedModel, draft: LoadedModel, cfg: JobConfig, ids: list[list[int]],
          limits: list[int]) -> tuple[list[list[int]], float, dict[str, Any] | None, int]:
    """(outputs, seconds, the autopilot's report, prompt tokens read from the prefix cache)."""
    from specbatch.engine import Engine, EngineRequest, GenerationParams

    engine = Engine(target, [draft] if cfg.speculative else [], batch_size=cfg.batch_size,
                    prefix_cache=cfg.prefix_cache)
    reqs = [EngineRequest(input_ids=x, params=GenerationParams(max_new_tokens=n)) for x, n in zip(ids, limits)]
    outs, seconds = generate_all(engine, reqs, target.device)
    return ([list(o.token_ids) for o in outs], seconds, engine.batch_report(),
            sum(o.stats.cached_prompt_tokens for o in outs))


def _hf(target: LoadedModel, draft: LoadedModel, cfg: JobConfig, ids: list[list[int]],
        limits: list[int]) -> tuple[list[list[int]], float]:
    if cfg.kind == "hf-assisted":
        runner = HFRunner(target, draft, HF_ASSISTED_SETTINGS["default"])
        outs, seconds = [], 0.0
        for x, n in zip(ids, limits):
            r = runner(x, n)
            outs.append(r.tokens)
            seconds += r.seconds
        return outs, seconds
    hf = HFRunner(target)
    b = int(cfg.batch_size)
    outs, seconds = [], 0.0
    for s in range(0, len(ids), b):
        chunk, sec = hf.batch(ids[s: s + b], max(limits[s: s + b]))
        outs.extend(chunk)
        seconds += sec
    return outs, seconds


def _open_llama_cpp(opts: JobBenchOptions, target: LoadedModel) -> tuple[LlamaCppRunner | None, dict[str, Any]]:
    """llama.cpp on the target's GGUF file, or None and why not (status "off": --no-llama-cpp)."""
    if not opts.llama_cpp:
        return None, {"status": "off"}
    return open_for_target(opts.target, opts.cache_dir, target.eos_token_ids)


def run_job_bench(opts: JobBenchOptions, target: LoadedModel, draft: LoadedModel,
                  requests: list[tuple[list[int], int]], say: Progress | None = None) -> dict[str, Any]:
    """``requests``: (prompt ids, max new tokens) per line of the file, in order."""
    say = say or (lambda *_: None)
    requests = requests[: opts.num_prompts] if opts.num_prompts else requests
    ids = [x for x, _ in requests]
    limits = [opts.max_new_tokens or n for _, n in requests]
    eos = target.eos_token_ids
    llama, llama_info = _open_llama_cpp(opts, target)
    configs = plan(opts.batch_sizes, opts.shared_prefix is not None, opts.prefix_cache, llama is not None)

    def clean(outs: list[list[int]]) -> list[list[int]]:
        return [cut_at_eos(o, eos)[:n] for o, n in zip(outs, limits)]

    acc: dict[str, dict[str, Any]] = {c.name: {"tokens": 0, "seconds": 0.0, "outputs": [], "cached": 0,
                                               "errors": []} for c in configs}
    reports: dict[str, Any] = {}
    total = len(configs) * opts.repeats
    try:
        _ours(target, draft, JobConfig("warm-up", "ours", 2, True), ids[:2], [4, 4])   # untimed
        if llama is not None:   # untimed; a batch it refuses shows in the rows that ask for one
            with contextlib.suppress(RuntimeError):
                llama.batch(ids[:2], [4, 4], batch_size=2)
        for r in range(opts.repeats):
            order = configs[r % len(configs):] + configs[: r % len(configs)]
            for i, cfg in enumerate(order):
                say(f"repeat {r + 1}/{opts.repeats}: {cfg.name}", r * len(configs) + i, total)
                a = acc[cfg.name]
                if cfg.kind == "ours":
                    outs, seconds, report, cached = _ours(target, draft, cfg, ids, limits)
                    a["cached"] += cached
                    if report is not None:
                        reports[f"{cfg.name}#{r + 1}"] = report
                elif cfg.kind == "llama-cpp":
                    assert llama is not None
                    try:   # the same token ids and limits; decoding time only (its context is made first)
                        outs, seconds = llama.batch(ids, limits, batch_size=int(cfg.batch_size))
                    except RuntimeError as e:   # llama.cpp refused the batch: its row says so, the run goes on
                        a["errors"].append(f"repeat {r + 1}: {e}")
                        continue
                else:
                    outs, seconds = _hf(target, draft, cfg, ids, limits)
                outs = clean(outs)
                a["tokens"] += sum(len(o) for o in outs)
                a["seconds"] += seconds
                a["outputs"].append(outs)
    finally:
        if llama is not None:
            llama.close()
    # the reference: the target alone, unbatched (the timed B=1 run when the grid has it)
    if acc.get("hf-generate[B=1]", {}).get("outputs"):
        reference = acc["hf-generate[B=1]"]["outputs"][0]
    else:
        say("reference: the target alone, unbatched", total, total + 1)
        ref_cfg = JobConfig("hf-generate[B=1]", "hf-generate", 1, False)
        reference = clean(_hf(target, draft, ref_cfg, ids, limits)[0])
    for a in acc.values():
        a["mismatch"] = sorted({j for outs in a["outputs"] for j, (o, ref) in enumerate(zip(outs, reference))
                                if o != ref})
        a["first_divergence"] = sorted(first_difference(o, ref) for o, ref in zip(a["outputs"][0], reference)
                                       if o != ref) if a["outputs"] else []
    auto = next((c for c in configs if c.name == "ours-auto"), None)
    profiled = None
    # the profile's buckets and the GEMM peak are the CPU's (CPU operators, a CPU sgemm): a GPU
    # job's time is in kernels they do not see, and its rate over a CPU's peak means nothing
    on_cpu = torch.device(target.device).type == "cpu"
    if auto is not None and opts.breakdown and on_cpu:
        say("ours-auto once more, under the profiler (untimed)", total, total + 1)
        profiled = breakdown.profile_pass(lambda: _ours(target, draft, auto, ids, limits), target.model,
                                          target.vocab_size)
    cfg = target.model.config.get_text_config()
    peak = breakdown.gemm_peak_gflops(cfg.hidden_size, cfg.intermediate_size,
                                      linears=packed_kernel(target.model) or "off") if on_cpu else 0.0
    params = sum(p.numel() for p in target.model.parameters())
    say("done", total, total)

    rows = []
    for c in configs:
        a = acc[c.name]
        # a configuration that failed in any repeat has no tokens/s: the others' would mix repeats
        tps = a["tokens"] / a["seconds"] if a["seconds"] and not a["errors"] else None
        rows.append({"name": c.name, "batch_size": c.batch_size, "speculative": c.speculative,
                     "tokens_per_second": tps, "identical": not a["mismatch"] and not a["errors"],
                     "kind": c.kind, "seconds": a["seconds"], "new_tokens": a["tokens"],
                     "mismatched_prompts": a["mismatch"], "first_divergence": a["first_divergence"],
                     "errors": a["errors"], "prefix_cache": c.prefix_cache,
                     "cached_prompt_tokens": a["cached"] // opts.repeats})
    fixed = [r for r in rows if r["kind"] == "ours" and r["batch_size"] != "auto" and r["tokens_per_second"]]
    best = max(fixed, key=lambda r: r["tokens_per_second"]) if fixed else None
    hf = [r for r in rows if r["kind"] == "hf-generate" and r["tokens_per_second"]]
    best_hf = max(hf, key=lambda r: r["tokens_per_second"]) if hf else None
    best_llama = _best_llama_cpp(rows)
    for row in rows:
        tps = row["tokens_per_second"]
        row["ratio_vs_best_fixed"] = tps / best["tokens_per_second"] if tps and best else None
        row["ratio_vs_best_hf_generate"] = tps / best_hf["tokens_per_second"] if tps and best_hf else None
        row["ratio_vs_best_llama_cpp"] = tps / best_llama["tokens_per_second"] if tps and best_llama else None
        row["gemm_peak_share"] = breakdown.peak_share(tps, params, peak)
    return {"job": rows, "best_fixed": best["name"] if best else None,
            "prefix_cache": _prefix_cache(acc, rows, sum(len(x) for x in ids)) if NO_PREFIX in acc else None,
            "best_hf_generate": best_hf["name"] if best_hf else None,
            "llama_cpp": _llama_cpp_summary(llama_info, rows, len(ids), best_llama) if opts.llama_cpp else None,
            "file": opts.file, "prompts": len(ids), "max_new_tokens": opts.max_new_tokens,
            "repeats": opts.repeats, "target": opts.target, "draft": opts.draft,
            "threads": torch.get_num_threads(), "device": str(target.device), "autopilot": reports,
            "gemm_peak_gflops": peak, "target_parameters": params, "breakdown": profiled}


def _best_llama_cpp(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """llama.cpp's fastest batched row (B > 1): the issue's bar for ours-auto."""
    pool = [r for r in rows if r["kind"] == "llama-cpp" and r["batch_size"] > 1 and r["tokens_per_second"]]
    return max(pool, key=lambda r: r["tokens_per_second"]) if pool else None


def _llama_cpp_summary(info: dict[str, Any], rows: list[dict[str, Any]], prompts: int,
                       best: dict[str, Any] | None) -> dict[str, Any]:
    """What the report says about llama.cpp: skipped and why, or per B its tokens/s and how many of
    its outputs equal the target's (in every repeat), and ours-auto against its best."""
    if info.get("status") != "ran":
        return info
    out = dict(info)
    lrows = [r for r in rows if r["kind"] == "llama-cpp"]
    # the shape report.llama_cpp_lines prints, as in the other modes
    out["batched"] = [{"batch_size": r["batch_size"], "tokens_per_second": r["tokens_per_second"],
                       "identical": prompts - len(r["mismatched_prompts"]), "outputs": prompts,
                       "first_divergence": r["first_divergence"]} for r in lrows if r["tokens_per_second"]]
    out["errors"] = {r["name"]: r["errors"] for r in lrows if r["errors"]}
    auto = next((r for r in rows if r["name"] == "ours-auto"), None)
    if best is not None:
        out["best"] = {"name": best["name"], "batch_size": best["batch_size"],
                       "tokens_per_second": best["tokens_per_second"],
                       "ours_auto_tokens_per_second": auto and auto["tokens_per_second"],
                       "ours_auto_vs_llama_cpp": auto and auto["ratio_vs_best_llama_cpp"]}
    return out


def _prefix_cache(acc: dict[str, dict[str, Any]], rows: list[dict[str, Any]], prompt_tokens: int
                  ) -> dict[str, Any]:
    """ours-auto with the prefix cache against ours-auto without it: the ratio of tokens/s, whether
    every output of every repeat is the same, and the share of prompt tokens read, not prefilled."""
    tps = {r["name"]: r["tokens_per_second"] for r in rows}
    on, off = tps.get("ours-auto"), tps.get(NO_PREFIX)
    cached = next(r["cached_prompt_tokens"] for r in rows if r["name"] == "ours-auto")
    return {"ratio": on / off if on and off else None,
            "identical": acc["ours-auto"]["outputs"] == acc[NO_PREFIX]["outputs"],
            "cached_prompt_tokens": cached, "prompt_tokens": prompt_tokens,
            "cached_share": cached / prompt_tokens if prompt_tokens else None}


PUBLIC_KEYS = ("name", "batch_size", "speculative", "tokens_per_second", "ratio_vs_best_fixed", "identical")


def public(result: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` shape: {"job": [{name, batch_size, speculative, tokens_per_second,
    ratio_vs_best_fixed, identical}], "best_fixed": NAME}, with "prefix_cache" and "llama_cpp"
    (ran or skipped and why) where the run has them."""
    out = {"job": [{k: r[k] for k in PUBLIC_KEYS} for r in result["job"]], "best_fixed": result["best_fixed"]}
    for key in ("prefix_cache", "llama_cpp"):
        if result.get(key) is not None:
            out[key] = result[key]
    return out


def _llama_cpp_lines(info: dict[str, Any] | None) -> list[str]:
    """The baseline's paragraph as the other modes print it (per B: tok/s, outputs identical to the
    target's), then ours-auto against its best batched configuration."""
    from specbatch.bench.report import llama_cpp_lines

    lines = llama_cpp_lines(info)
    if not info or info.get("status") != "ran":
        return lines
    lines.append("- Its outputs differ from the target's where Q4_1 kernels and the fp32 dequantized weights "
                 "break a near-tie differently: counted, never a failure.")
    lines += [f"- {name} failed: {'; '.join(errs)}" for name, errs in info.get("errors", {}).items()]
    best = info.get("best")
    if best:
        tps, ratio = best["ours_auto_tokens_per_second"], best["ours_auto_vs_llama_cpp"]
        lines.append(f"- ours-auto against llama.cpp's best batched configuration (`{best['name']}`, "
                     f"{best['tokens_per_second']:.1f} tok/s): "
                     + ("-" if not tps or not ratio else f"{tps:.1f} tok/s, {ratio:.2f}x") + ".")
    return lines


def markdown(result: dict[str, Any], command: str | None = None) -> str:
    def f(x: Any, fmt: str = ".2f") -> str:
        return "-" if x is None else format(x, fmt)

    lines = [f"# specbatch bench --job {Path(result['file']).name}", ""]
    if command:
        lines += ["```", command, "```", ""]
    def identical(r: dict[str, Any]) -> str:
        if r["kind"] == "llama-cpp":   # its numerics differ by design: a count, not a verdict
            return "-" if r["errors"] else f"{result['prompts'] - len(r['mismatched_prompts'])}/{result['prompts']}"
        return "yes" if r["identical"] else "NO"

    llama = (result.get("llama_cpp") or {}).get("best") is not None
    lines += [f"{result['prompts']} prompts, target {result['target']}, draft {result['draft']}, "
              f"{result['device']}, {result['threads']} threads, {result['repeats']} repeat(s); "
              f"max new tokens: {result['max_new_tokens'] or 'per line'}.", "",
              "| configuration | B | speculative | tokens/s | vs best fixed | vs best HF generate "
              + ("| vs best llama.cpp " if llama else "") + "| identical |",
              "|---|---:|---|---:|---:|---:|" + ("---:|" if llama else "") + "---|"]
    for r in result["job"]:
        lines.append(f"| {r['name']} | {r['batch_size']} | {r['speculative']} | {f(r['tokens_per_second'], '.1f')} "
                     f"| {f(r['ratio_vs_best_fixed'])} | {f(r['ratio_vs_best_hf_generate'])} "
                     + (f"| {f(r.get('ratio_vs_best_llama_cpp'))} " if llama else "") + f"| {identical(r)} |")
    lines += ["", f"best fixed: {result['best_fixed']}; best HF generate: {result['best_hf_generate']}."]
    if result.get("gemm_peak_gflops"):
        auto = next((r for r in result["job"] if r["name"] == "ours-auto"), None)
        share = auto and auto.get("gemm_peak_share")
        lines.append(f"fp32 GEMM peak measured in this run: {result['gemm_peak_gflops']:.0f} GFLOPS; ours-auto's "
                     f"useful work (2 x {result['target_parameters'] / 1e6:.0f}M FLOPs a token) is "
                     f"{f(share and 100 * share, '.0f')}% of it.")
    if result.get("llama_cpp"):
        lines += [*_llama_cpp_lines(result["llama_cpp"]), ""]
    if result.get("breakdown"):
        lines += ["", *breakdown.markdown_lines(result["breakdown"]), ""]
    if (pc := result.get("prefix_cache")) is not None:
        lines.append(f"prefix cache: ours-auto on / off = {f(pc['ratio'])}x tokens/s; outputs on vs off "
                     f"{'identical' if pc['identical'] else 'DIFFERENT'}; {pc['cached_prompt_tokens']} of "
                     f"{pc['prompt_tokens']} prompt tokens ({f(pc['cached_share'] and 100 * pc['cached_share'], '.0f')}%) "
                     "read from the cache, not prefilled.")
    for name, rep in result["autopilot"].items():
        if name.startswith("ours-auto"):
            shares = ", ".join(f"B={k} {v:.0%}" for k, v in rep["batch_size_share"].items())
            spec = rep["speculated_step_share"]
            lines.append(f"{name}: kept B={rep['chosen']['batch_size']}, speculative "
                         f"{rep['chosen']['speculative']}; time by B: {shares}; speculated "
                         f"{f(spec and 100 * spec, '.0f')}% of steps; exploration {rep['explore_steps']} "
                         f"of {rep['steps']} steps.")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> Path:
    """tokens/s against B for each mode; ours-auto as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["job"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pick in (("ours, speculative", lambda r: r["kind"] == "ours" and r["speculative"] is True),
                        ("ours, target alone", lambda r: r["kind"] == "ours" and r["speculative"] is False),
                        ("HF generate", lambda r: r["kind"] == "hf-generate"),
                        ("llama.cpp (Q4_1)", lambda r: r["kind"] == "llama-cpp")):
        pts = sorted((r["batch_size"], r["tokens_per_second"] or 0) for r in rows if pick(r))
        if pts:
            ax.plot(*zip(*pts, strict=True), "o-", label=label)
    for r in rows:
        if r["name"] == "ours-auto" and r["tokens_per_second"]:
            ax.axhline(r["tokens_per_second"], color="tab:red", ls="--", lw=1, label="ours-auto")
        if r["kind"] == "hf-assisted" and r["tokens_per_second"]:
            ax.scatter([1], [r["tokens_per_second"]], marker="x", color="black", label="HF assisted (B=1)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B")
    ax.set_ylabel("generated tokens/s (whole file)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_files(result: dict[str, Any], out_dir: Path, command: str | None) -> dict[str, str]:
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "job-report.md"
    md.write_text(markdown(result, command), encoding="utf-8")
    js = out_dir / "job-result.json"
    js.write_text(json.dumps(result, indent=2, default=str), encoding="utf-8")
    files = {"markdown": str(md), "json": str(js)}
    files["plot"] = str(plot(result, out_dir / "job-throughput.png"))
    return files
