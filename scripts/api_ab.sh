#!/bin/bash
# Two trees' API under load, interleaved A B B A per backend (issue 32 item 7; docs/bench/api-load.md):
#   scripts/api_ab.sh TREE_A TREE_B [sqlite] [pg]      e.g. git archive main | tar -x -C /tmp/base
# Each run: `serve --workers 2` from the tree (PYTHONPATH), a fresh database, the seed, then this
# checkout's api_load.py (the same script for both) with 200 clients for 15 s and /healthz probed
# every 50 ms from a process of its own (and on `serve --health-port 8766` where the tree has it,
# by a second probe process in the same run); one JSON line per run, tagged with the tree and backend.
# Needs an activated venv with specbatch's dependencies, Redis (db 14) and PostgreSQL on their default ports.
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
A=$1 B=$2; shift 2
backends=${*:-sqlite pg}
run() {  # tree tag backend
  rm -rf /tmp/apiab; mkdir -p /tmp/apiab/files
  if [ "$3" = sqlite ]; then export SPECBATCH_DATABASE_URL=sqlite:////tmp/apiab/db.sqlite; else
    psql -q -h 127.0.0.1 -U postgres -d test -c 'DROP DATABASE IF EXISTS apiab WITH (FORCE)' -c 'CREATE DATABASE apiab' >/dev/null
    export SPECBATCH_DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1:5432/apiab; fi
  export SPECBATCH_FILES_DIR=/tmp/apiab/files SPECBATCH_BROKER_URL=redis://127.0.0.1:6379/14
  PYTHONPATH=$1 specbatch db upgrade >/dev/null 2>&1
  hp=(); also=()      # a tree with `serve --health-port`: probed there too, in the same run
  if grep -q health-port "$1/specbatch/cli/serve.py"; then hp=(--health-port 8766); also=(--also-health-url http://127.0.0.1:8766); fi
  PYTHONPATH=$1 specbatch serve --port 8765 --log-level warning --workers 2 "${hp[@]}" > /tmp/apiab/serve.log 2>&1 & SP=$!
  sleep 10
  python "$here/scripts/api_load.py" --url http://127.0.0.1:8765 --clients 20 --seconds 3 --json >/dev/null
  out=$(python "$here/scripts/api_load.py" --url http://127.0.0.1:8765 --clients 200 --seconds 15 \
        --health-every 0.05 --server-pid $SP --json "${also[@]}")
  echo "{\"utc\": \"$(date -u +%H:%M)\", \"tree\": \"$2\", \"backend\": \"$3\", \"run\": $out}"
  kill -INT $SP; wait $SP 2>/dev/null; sleep 2
}
for b in $backends; do
  run "$A" A "$b"; run "$B" B "$b"; run "$B" B "$b"; run "$A" A "$b"
done
psql -q -h 127.0.0.1 -U postgres -d test -c 'DROP DATABASE IF EXISTS apiab WITH (FORCE)' >/dev/null 2>&1
