"""A worker's parent process never runs a model: it must not pay for importing torch.

The parent imports the task module (Celery registers its tasks) and the CLI; importing torch and
transformers there cost 5-10 s of every start on a loaded 2-core machine (docs/COMPILE.md,
"Worker start-up time"), before the pool child, which needs them, even started.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import specbatch


def test_the_worker_parent_imports_no_torch(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(specbatch.__file__).resolve().parents[1])}   # this tree
    code = ("import sys; import specbatch.cli.queue, specbatch.worker.runner, specbatch.worker.tasks; "
            "print(' '.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         cwd=tmp_path, env=env)
    assert out.stdout.strip() == ""
