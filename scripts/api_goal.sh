#!/bin/bash
# the API goal (issue 32 item 7) on a quieter machine: main, 200 clients, 15 s, SQLite then PostgreSQL, twice
# (run from an activated venv with specbatch installed; Redis and PostgreSQL on their default ports)

cd "$(dirname "$0")/.."
for round in 1 2; do
for dbk in sqlite pg; do
  rm -rf /tmp/apiq; mkdir -p /tmp/apiq/files
  if [ $dbk = sqlite ]; then export SPECBATCH_DATABASE_URL=sqlite:////tmp/apiq/db.sqlite; else
    psql -q -h 127.0.0.1 -U postgres -d test -c 'DROP DATABASE IF EXISTS apiq WITH (FORCE)' -c 'CREATE DATABASE apiq' >/dev/null
    export SPECBATCH_DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1:5432/apiq; fi
  export SPECBATCH_FILES_DIR=/tmp/apiq/files
  specbatch db upgrade >/dev/null 2>&1
  specbatch serve --port 8765 --log-level warning --workers 2 --health-port 8766 > /tmp/apiq/serve.log 2>&1 & SP=$!; sleep 10
  python scripts/api_load.py --url http://127.0.0.1:8765 --clients 20 --seconds 3 --json >/dev/null
  echo "== $dbk round $round load $(cut -d' ' -f1-3 /proc/loadavg)"
  # /healthz every 50 ms (~290 probes) on the API port and, from a second probe process, on the health port
  python scripts/api_load.py --url http://127.0.0.1:8765 --clients 200 --seconds 15 --server-pid $SP --json \
    --health-every 0.05 --also-health-url http://127.0.0.1:8766
  kill -INT $SP; wait $SP 2>/dev/null; sleep 2
done; done
psql -q -h 127.0.0.1 -U postgres -d test -c 'DROP DATABASE IF EXISTS apiq WITH (FORCE)' >/dev/null
