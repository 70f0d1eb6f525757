"""The Markdown table and the PNG plots of a bench result (the dict ``run_bench`` returns)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _f(x: Any, fmt: str = ".2f", suffix: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "**NO**"
    return f"{x:{fmt}}{suffix}"


def markdown(result: dict[str, Any], command: str | None = None) -> str:
    """The whole report: setup, per-configuration table, costs, per-position acceptance, throughput."""
    o = result["options"]
    lines = [f"# specbatch bench: {result['target']} with {', '.join(result['drafters']) or 'no drafters'}",
             ""]
    if command:
        lines += ["```", command, "```", ""]
    env = result["environment"]
    lines += [f"{len(result['prompts'])} prompts x {o['max_new_tokens']} new tokens, {o['repeats']} "
              f"repeats, interleaved; greedy; device {env['device']} ({env['threads']} threads), "
              f"{o['dtype']}, torch {env['torch']}"
              + (", **random weights** (speed only)" if o.get("random_weights") else "")
              + f". Best HF assisted: `{result['best_hf_assisted']}`.", ""]
    lines += ["| config | tok/s | speedup vs target | vs HF assisted (best) | acceptance rate | "
              "mean acc. length | alpha | gamma | c | draft cost/step | T(k)/T(1) | bound | efficiency | identical |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|"]
    for c in result["configs"]:
        vr = c.get("verify_cost_ratio")
        vt = c.get("verify_tokens")
        lines.append(
            f"| {c['name']} | {_f(c['tokens_per_second'], '.1f')} | {_f(c['speedup_vs_target'], '.2f', 'x')} "
            f"| {_f(c['ratio_vs_hf_assisted'], '.2f', 'x')} | {_f(c['acceptance_rate'])} "
            f"| {_f(c['mean_acceptance_length'])} | {_f(c['alpha'])} | {_f(c['gamma_mean'], '.1f')} "
            f"| {_f(c['c'], '.3f')} | {_f(c['draft_cost_per_step'])} "
            f"| {_f(vr) + (f' (k={vt:.1f})' if vt else '')} | {_f(c['bound'], '.2f', 'x')} "
            f"| {_f(c['efficiency'])} | {_f(c['identical'])} |")
    costs = result["costs"]
    lines += ["", f"Step costs measured directly (medians of timings taken between the rounds of runs, prefix of {costs['prefix_tokens']} tokens): "
              "target T(k) for scoring k tokens in one forward, each draft's one-token step. A mean "
              "draft length between two sizes is interpolated. "
              f"Noise: max/min of the timings up to {max(costs.get('max_over_min', {}).values(), default=1):.2f}.",
              "", "| k | T(k) ms | T(k)/T(1) |", "|---:|---:|---:|"]
    for k, ms in costs["target_step_ms"].items():
        lines.append(f"| {k} | {ms:.1f} | {costs['verify_ratio'][k]:.2f} |")
    for name, ms in costs["draft_step_ms"].items():
        lines.append(f"| draft {name} | {ms:.1f} | c = {costs['c'][name]:.3f} |")
    if costs.get("compiled_step_ms"):
        lines += ["", "Through the compiled forward (timed alternately with the eager T(k) above):", "",
                  "| k | eager T(k) ms | compiled T(k) ms | compiled T(k)/T(1) | compiled / eager |",
                  "|---:|---:|---:|---:|---:|"]
        for k, ms in costs["compiled_step_ms"].items():
            lines.append(f"| {k} | {costs['target_step_ms'][k]:.1f} | {ms:.1f} "
                         f"| {costs['compiled_verify_ratio'][k]:.2f} | {costs['compiled_vs_eager'][k]:.2f} |")
    comp = result.get("compile")
    if comp:
        lines += ["", f"Compiling ({'cached' if comp['this_start_cached'] else 'first start'}): "
                  f"{comp['seconds']:.0f} s this start; {comp['reason']}.", "",
                  "| model | this start s | first start s | cached | graphs (first call; eager / compiled "
                  "step at warm-up) |", "|---|---:|---:|---|---|"]
        for m in comp["models"]:
            speedups = m.get("speedups") or {}
            graphs = ", ".join(f"{k} {v:.0f}s" + (f" ({speedups[k]:.2f}x)" if k in speedups else "")
                               for k, v in m["graphs"].items())
            lines.append(f"| {m['model']} | {m['seconds']:.0f} | {_f(m['first_start_seconds'], '.0f')} "
                         f"| {m['cached']} | {graphs} |")
        for m in comp["models"]:   # a first start here compared frozen and not frozen graphs
            gain = m.get("frozen_gain") or {}
            if gain and any(math.isinf(v) for v in gain.values()):
                lines += ["", f"- {m['model']}: the not-frozen graphs failed to compile; kept frozen."]
            elif gain:
                lines += ["", f"- {m['model']}: not-frozen / frozen step time "
                          + ", ".join(f"{k} {v:.2f}x" for k, v in gain.items())
                          + f"; kept {'frozen' if m.get('frozen') else 'not frozen'} (docs/COMPILE.md)."]
        calls = comp.get("forward_calls") or {}
        lines += [""] if calls else []
        for model, n in calls.items():
            lines.append(f"- {model}: {n['calls']} forwards after warm-up, {n['misses']} of them matched no "
                         "warmed graph and ran eagerly"
                         + (" (the compiled numbers above include eager steps)" if n["misses"] else "") + ".")
    width = max((len(c["accepted_per_position"]) for c in result["configs"]), default=0)
    if width:
        width = min(width, 10)
        lines += ["", "Acceptance per draft position j (accepted at j / steps that drafted j):", "",
                  "| config | " + " | ".join(str(j + 1) for j in range(width)) + " |",
                  "|---|" + "---:|" * width]
        for c in result["configs"]:
            pp = c["accepted_per_position"]
            if pp:
                cells = [f"{pp[j]:.2f}" if j < len(pp) else "" for j in range(width)]
                lines.append(f"| {c['name']} | " + " | ".join(cells) + " |")
    if result.get("throughput"):
        lines += ["", f"Throughput: {result['throughput'][0]['prompts']} prompts, total generated "
                  "tokens/s (speculative: `generate_many(batch_size=B)`; target: HF `generate` on "
                  "left-padded batches; compiled runs add plain decoding through the compiled forward "
                  "and the same eagerly, plain-eager; llama-cpp: B sequences in one `llama_batch`, "
                  "a finished one's slot taking the next prompt, with plain-eager beside it).", "",
                  "| B | mode | tok/s | vs first B | vs target at B | vs plain-eager at B | identical |",
                  "|---:|---|---:|---:|---:|---:|:-:|"]
        for t in result["throughput"]:
            lines.append(f"| {t['batch_size']} | {t['mode']} | {_f(t['tokens_per_second'], '.1f')} "
                         f"| {_f(t['vs_first_batch_size'], '.2f', 'x')} "
                         f"| {_f(t['speedup_vs_target'], '.2f', 'x')} "
                         f"| {_f(t.get('vs_plain_eager'), '.2f', 'x')} | {_f(t['identical'])} |")
    lines += llama_cpp_lines(result.get("llama_cpp"))
    if result["failures"]:
        lines += ["", "**Failures** (outputs not identical to the target's, or errors):", ""]
        lines += [f"- {f}" for f in result["failures"]]
    if result["warnings"]:
        lines += ["", "Baseline warnings (Hugging Face outputs that differ from the target alone):", ""]
        lines += [f"- {w}" for w in result["warnings"]]
    return "\n".join(lines) + "\n"


def llama_cpp_lines(info: dict[str, Any] | None) -> list[str]:
    """The llama.cpp baseline's paragraph: skipped and why, or its speed against ours and how many
    of its outputs equal the target's."""
    if not info or info.get("status") == "off":
        return []
    if info.get("status") != "ran":
        return ["", f"llama.cpp baseline: skipped: {info.get('reason')}."]
    name = Path(info["gguf"]).name
    out = ["", f"llama.cpp baseline (llama-cpp-python {info.get('version')}, `{name}`, the file the target "
           f"is dequantized from, {info['threads']} threads, our token ids, greedy argmax over its logits):", ""]
    b1 = info.get("b1")
    if b1:
        div = ", ".join(map(str, b1["first_divergence"])) or "-"
        out.append(f"- B=1: {b1['tokens_per_second']:.1f} tok/s, {_f(b1['vs_target'], '.2f', 'x')} the target; "
                   f"our best B=1 (`{b1['ours_best']}`) is {_f(b1['ours_best_vs_llama_cpp'], '.2f', 'x')} "
                   f"llama.cpp. Outputs identical to the target's: {b1['identical']}/{b1['outputs']} "
                   f"(first divergence at token {div}: Q4_1 kernels vs fp32 dequantized weights).")
    for t in info.get("batched") or []:
        out.append(f"- B={t['batch_size']}: {t['tokens_per_second']:.1f} tok/s, identical to the target's "
                   f"{t['identical']}/{t['outputs']}.")
    best = info.get("best_batched")
    if best:
        out.append(f"- Best batched: llama.cpp at B={best['batch_size']}, {best['tokens_per_second']:.1f} tok/s; "
                   f"our best batched (`{best['ours_best']}`, {_f(best['ours_best_tokens_per_second'], '.1f')} "
                   f"tok/s) is {_f(best['ours_best_vs_llama_cpp'], '.2f', 'x')} llama.cpp.")
    return out


def plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """speedup_vs_drafters.png, speedup_vs_gamma.png, acceptance_per_position.png (+ throughput.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    cfgs = result["configs"]
    written: list[Path] = []

    def hlines(ax: Any) -> None:
        ax.axhline(1.0, color="gray", lw=1, ls=":", label="target alone")
        best = next((c for c in cfgs if c["name"] == result.get("best_hf_assisted")), None)
        if best and best["speedup_vs_target"]:
            ax.axhline(best["speedup_vs_target"], color="tab:red", lw=1, ls="--",
                       label=f"HF assisted best ({best['hf_setting']})")

    def save(fig: Any, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    # 1. speedup vs number of drafters: pools of growing size (drafter order as given)
    first = result["drafters"][0] if result["drafters"] else None
    pool = [c for c in cfgs if c["kind"] == "ours" and (c["group"] == "pool" or (
        c["group"] == "drafter" and c["drafters"] == [first]))]
    pool.sort(key=lambda c: c["n_drafters"])
    fig, ax = plt.subplots(figsize=(6, 4))
    if pool:
        ax.plot([c["n_drafters"] for c in pool], [c["speedup_vs_target"] or 0 for c in pool], "o-",
                label="ours (pool, adaptive gamma)")
        for c in pool:
            ax.annotate("+".join(c["drafters"]), (c["n_drafters"], c["speedup_vs_target"] or 0),
                        fontsize=6, textcoords="offset points", xytext=(3, 3))
    singles = [c for c in cfgs if c["group"] == "drafter"]
    if singles:
        ax.scatter([1] * len(singles), [c["speedup_vs_target"] or 0 for c in singles], marker="x",
                   color="tab:green", label="each drafter alone")
    hlines(ax)
    ax.set_xlabel("drafters in the pool")
    ax.set_ylabel("speedup vs target alone")
    ax.set_xticks(range(1, max([c["n_drafters"] for c in pool], default=1) + 1))
    ax.legend(fontsize=7)
    save(fig, "speedup_vs_drafters.png")

    # 2. speedup vs gamma: fixed gamma grid, adaptive and HF as reference lines
    grid = sorted((c for c in cfgs if c["group"] == "gamma"), key=lambda c: c["gamma"])
    fig, ax = plt.subplots(figsize=(6, 4))
    if grid:
        ax.plot([c["gamma"] for c in grid], [c["speedup_vs_target"] or 0 for c in grid], "o-",
                label="ours, fixed gamma (measured)")
        bounds = [(c["gamma"], c["bound"]) for c in grid if c.get("bound")]
        if bounds:
            ax.plot(*zip(*bounds, strict=True), "s--", color="tab:orange", alpha=0.7,
                    label="analytic bound (Leviathan et al.)")
    adaptive = next((c for c in cfgs if c["group"] == "drafter" and c["drafters"] == [first]), None)
    if adaptive and adaptive["speedup_vs_target"]:
        ax.axhline(adaptive["speedup_vs_target"], color="tab:green", lw=1, ls="-.", label="ours, adaptive")
    hlines(ax)
    ax.set_xlabel("gamma (draft tokens per step)")
    ax.set_ylabel("speedup vs target alone")
    ax.set_title(f"draft: {first}", fontsize=8)
    ax.legend(fontsize=7)
    save(fig, "speedup_vs_gamma.png")

    # 3. acceptance per position
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in cfgs:
        pp = c.get("accepted_per_position") or []
        show = c["group"] in ("drafter", "pool") or (bool(grid) and c is grid[-1])
        if pp and show:
            ax.plot(range(1, len(pp) + 1), pp, "o-", ms=3, label=c["name"])
    ax.set_xlabel("draft position j")
    ax.set_ylabel("accepted at j / steps that drafted j")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=6)
    save(fig, "acceptance_per_position.png")

    if result.get("throughput"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in ("speculative", "plain", "plain-eager", "target", "llama-cpp"):
            rows = [t for t in result["throughput"] if t["mode"] == mode]
            if not rows:
                continue
            ax.plot([t["batch_size"] for t in rows], [t["tokens_per_second"] or 0 for t in rows], "o-",
                    label=mode)
        ax.set_xlabel("batch size B")
        ax.set_ylabel("total generated tokens/s")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
        save(fig, "throughput.png")
    return written


def write_all(result: dict[str, Any], out_dir: Path, command: str | None = None) -> dict[str, str]:
    """report.md, result.json and the plots under out_dir; returns {kind: path}."""
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "report.md"
    md.write_text(markdown(result, command), encoding="utf-8")
    js = out_dir / "result.json"
    js.write_text(json.dumps(result, indent=2, default=str), encoding="utf-8")
    files = {"markdown": str(md), "json": str(js)}
    for p in plots(result, out_dir):
        files[p.stem] = str(p)
    return files
