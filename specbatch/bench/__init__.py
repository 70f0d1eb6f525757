"""Benchmark harness: ours against the baselines people would otherwise use, in one run.

    from specbatch.bench.harness import BenchOptions, run_bench
    result = run_bench(BenchOptions(target="smollm2-135m", drafts=("smollm2-135m-int8",), ngram=True))
    result["configs"]  # one dict per configuration: tokens/s, speedups, acceptance, bound, efficiency

Only ``specbatch.cli.bench`` prints; this package returns data.
"""
