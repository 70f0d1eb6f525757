"""What workers report about their work: Prometheus metrics (``metrics``), OpenTelemetry traces
(``tracing``), and the per-process hook that feeds both from each finished request (``worker``).

Nothing here is imported by the engine; the engine's GenerationStats are the only input.
"""
