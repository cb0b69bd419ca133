-- The ceiling a replay is measured against: one indexed read of a recorded response by
-- its key (given with -D), for bench/bench.py's pgbench cases.
SELECT status, headers, body FROM idemproxy.records WHERE key = :replayed::text;
