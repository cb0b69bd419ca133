-- The ceiling a fresh request's two statements are measured against: a bare INSERT of
-- the row a claim writes and an UPDATE of it to what a completion writes, by key, with
-- no condition, no CTE and no function, in two transactions as the proxy's are. For
-- bench/bench.py's pgbench cases; the values are given with -D.
\set key random(1, 9000000000000000000)
INSERT INTO idemproxy.records (key, fingerprint, state, owner, expires_at, lease_until) VALUES (:key::text, :fingerprint::bytea, 'in_flight', :owner::bytea, now() + interval '1 day', now() + interval '30 s');
UPDATE idemproxy.records SET state = 'completed', owner = NULL, lease_until = NULL, status = :status::smallint, headers = :headers::bytea, body = :body::bytea, completed_at = now() WHERE key = :key::text;
