-- Plain SQL over the specbatch_results view (requests LEFT JOIN results: one row per request, one
-- per sample of a request with n > 1).
-- Works as is in SQLite and PostgreSQL:
--   sqlite3 ~/.local/share/specbatch/specbatch.db < examples/results.sql
--   psql postgresql://postgres@127.0.0.1:5432/specbatch -f examples/results.sql

-- 1. Per job: requests, samples stored (a request with n > 1 has n), completed requests, tokens,
--    acceptance rate (token-weighted),
--    mean acceptance length (tokens per target forward) and tokens per second of one request's
--    decoding (requests decode in batches, so the job's own rate is higher: `specbatch status JOB`).
SELECT job_id,
       COUNT(DISTINCT request_id) AS requests,
       COUNT(text) AS samples,
       COUNT(DISTINCT CASE WHEN status = 'completed' THEN request_id END) AS completed,
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

-- 2. The five slowest completed requests of the newest job, with the start of their text (one row
--    per sample: sample_index tells the samples of one request apart).
SELECT custom_id,
       sample_index,
       completion_tokens,
       ROUND(CAST(latency_seconds AS NUMERIC), 2) AS latency_seconds,
       ROUND(CAST(acceptance_rate AS NUMERIC), 3) AS acceptance_rate,
       SUBSTR(text, 1, 60) AS text_start
FROM specbatch_results
WHERE status = 'completed'
  AND job_id = (SELECT id FROM jobs ORDER BY created_at DESC LIMIT 1)
ORDER BY latency_seconds DESC, custom_id, sample_index
LIMIT 5;

-- 3. Requests that did not complete, and why (failed, cancelled, still pending).
SELECT job_id, custom_id, line_no, status, attempts, error
FROM specbatch_results
WHERE status <> 'completed'
ORDER BY job_id, line_no;
