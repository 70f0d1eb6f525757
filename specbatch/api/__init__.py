"""The HTTP API (``specbatch serve``): OpenAI's Files and Batches endpoints in front of the job queue,
plus /v1/batches/{id}/stats, /healthz and /metrics. It never loads a model: batches become jobs
that the workers run. Build it with ``create_app(settings)`` (specbatch.api.app)."""
