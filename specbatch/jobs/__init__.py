"""Jobs: JSONL intake and validation (intake), the store's operations (store), statistics (stats)
and dataset export (export). Plain functions; the caller owns the session."""
