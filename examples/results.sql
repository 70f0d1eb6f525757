-- Plain SQL over the specbatch_results view (requests LEFT JOIN results, one row per request).
-- Works as is in SQLite and PostgreSQL:
--   sqlite3 ~/.local/share/specbatch/specbatch.db < examples/results.sql
--   psql postgresql://postgres@127.0.0.1:5432/specbatch -f examples/results.sql

-- 1. Per job: requests, completed, tokens, acceptance rate (token-weighted),
--    mean acceptance length (tokens per target forward) and tokens per second of one request's
--    decoding (requests decode in batches, so the job's own rate is higher: `specbatch status JOB`).
SELECT job_id,
       COUNT(*) AS requests,
       SUM(CASE WHEN status = 'completed' THEN 1 ELSE 0 END) AS completed,
       SUM(completion_tokens) AS tokens,
       ROUND(CAST(SUM(accepted_tokens) * 1.0 / NULLIF(SUM(drafted_tokens), 0) AS NUMERIC), 3)
           AS acceptance_rate,
       ROUND(CAST(SUM(accepted_tokens + verify_steps) * 1.0 / NULLIF(SUM(verify_steps), 0) AS NUMERIC), 2)
           AS mean_acceptance_length,
       ROUND(CAST(SUM(completion_tokens) / NULLIF(SUM(wall_seconds), 0) AS NUMERIC), 1)
           AS request_tokens_per_second
FROM specbatch_results
GROUP BY job_id
ORDER BY job_id;

-- 2. The five slowest completed requests of the newest job, with the start of their text.
SELECT custom_id,
       completion_tokens,
       ROUND(CAST(latency_seconds AS NUMERIC), 2) AS latency_seconds,
       ROUND(CAST(acceptance_rate AS NUMERIC), 3) AS acceptance_rate,
       SUBSTR(text, 1, 60) AS text_start
FROM specbatch_results
WHERE status = 'completed'
  AND job_id = (SELECT id FROM jobs ORDER BY created_at DESC LIMIT 1)
ORDER BY latency_seconds DESC, custom_id
LIMIT 5;

-- 3. Requests that did not complete, and why (failed, cancelled, still pending).
SELECT job_id, custom_id, line_no, status, attempts, error
FROM specbatch_results
WHERE status <> 'completed'
ORDER BY job_id, line_no;
