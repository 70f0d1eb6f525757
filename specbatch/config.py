"""Settings: the only module that reads the environment (SPECBATCH_* variables)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields
from pathlib import Path


def _user_dir(xdg_var: str, fallback: str) -> Path:
    base = os.environ.get(xdg_var) or str(Path.home() / fallback)
    return Path(base) / "specbatch"


@dataclass(frozen=True)
class Settings:
    database_url: str
    broker_url: str = "redis://127.0.0.1:6379/0"
    cache_dir: str = ""
    visibility_timeout: int = 3600      # seconds; above the longest task
    lease_seconds: int = 300            # a claimed request's lease, renewed while working
    max_attempts: int = 3               # a request that kills its worker this often is failed
    chunk_size: int = 8                 # request ids per Celery task
    max_requests: int = 100_000         # per prompt file
    max_line_bytes: int = 1_000_000     # per JSONL line
    default_target: str = "smollm2-135m"
    default_draft: str = "smollm2-135m-int8"
    device: str = "cpu"
    dtype: str = "float32"
    batch_size: str = "auto"            # "auto" (the throughput autopilot) or rows decoded together
    max_memory: str = ""                # KV cache + activations budget, e.g. "8GiB"; "": a share of free
    threads: int = 0                    # torch CPU threads; 0: usable cores / local_workers
    local_workers: int = 1              # worker processes started together on this machine
    flower_user: str = "admin"
    flower_password: str = ""
    flower_port: int = 5555

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        data_dir = _user_dir("XDG_DATA_HOME", ".local/share")
        values: dict[str, object] = {
            "database_url": f"sqlite:///{data_dir / 'specbatch.db'}",
            "cache_dir": str(_user_dir("XDG_CACHE_HOME", ".cache")),
        }
        for f in fields(cls):
            raw = env.get(f"SPECBATCH_{f.name.upper()}")
            if raw is None or raw == "":
                continue
            values[f.name] = int(raw) if f.type in ("int", int) else raw
        return cls(**values)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings. Tests call ``get_settings.cache_clear()`` after changing env."""
    return Settings.from_env()
