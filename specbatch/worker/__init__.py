"""Celery on Redis: the app, thin tasks, and the chunk loop shared with the embedded runner.

Import the pieces from their modules (``specbatch.worker.queues``, ``.enqueue``, ``.monitor``,
``.chunk``, ``.embedded``); importing this package imports nothing heavy.
"""
