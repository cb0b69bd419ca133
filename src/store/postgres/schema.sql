-- The idemproxy record store's schema, version 4 (docs/design.md §22), in the schema
-- named by store.schema. `idemproxy store schema --config F` prints this with the
-- names filled in; with store.migrate = true (the default) each proxy applies it at
-- start, in one transaction under an advisory lock, so that instances starting at
-- once migrate once. Every statement may run again: a schema at this version is left
-- as it is, its functions replaced by this version's.
--
-- Each step of a record's lifecycle is one function below, called in one round trip,
-- one transaction: the same compare-and-set on the owner token and the in-flight state
-- as the Redis store's Lua scripts (src/store/scripts), on the server's clock. Times
-- are the server's clock_timestamp() when the call begins; a record whose expires_at
-- has passed is absent to every function, whether or not the sweeper has deleted it.
-- The tables are logged (never UNLOGGED: those are emptied after a crash, and absent
-- on standbys).

CREATE SCHEMA IF NOT EXISTS {schema};

-- What version this schema is at, and the key the proxy's scope numbers are made with
-- (idempotency::scope_id): one for every instance on this schema, so that a tenant's
-- records count against one share whichever instance claimed them.
CREATE TABLE IF NOT EXISTS {schema}.meta (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    version integer NOT NULL,
    identity bytea NOT NULL CHECK (length(identity) = 16)
);

-- One row per record. key is the store key (prefix:route:{record hash}): no client
-- bytes. state is in_flight (owner, lease_until), completed (status, headers, body)
-- or unknown (owner, reason, and the probe's schedule: probe_give_up is NULL when
-- none was scheduled, probe_due NULL once the probe has given up).
CREATE TABLE IF NOT EXISTS {schema}.records (
    key text PRIMARY KEY,
    fingerprint bytea NOT NULL,
    state text NOT NULL CHECK (state IN ('in_flight', 'completed', 'unknown')),
    owner bytea,
    expires_at timestamptz NOT NULL,
    lease_until timestamptz,
    status smallint,
    headers bytea,
    body bytea,
    reason text,
    probe_due timestamptz,
    probe_give_up timestamptz,
    -- The tenant the record counts against (store.max_records_per_scope), or NULL.
    scope bigint,
    -- A waiter on another connection asked to be told when this claim changes.
    waited boolean NOT NULL DEFAULT false
);

CREATE INDEX IF NOT EXISTS records_expires_at ON {schema}.records (expires_at);

-- Version 2 (`remember`, docs/design.md §24): a record may outlive its response.
-- response_until is when a completed record's headers and body are dropped (NULL: with
-- the record), completed_at when its operation completed (what a 410 names). The
-- index holds only the rows whose response is still to drop, for the sweeper.
ALTER TABLE {schema}.records ADD COLUMN IF NOT EXISTS response_until timestamptz;
ALTER TABLE {schema}.records ADD COLUMN IF NOT EXISTS completed_at timestamptz;
-- Version 3: the index holds the rows whose response is still to drop, as before, by
-- response_until alone (a response dropped sets it to -infinity, which reads as past
-- its retention everywhere): an index that named body made every completion (which
-- writes body) update every index of its row, where now it is a heap-only (HOT)
-- update; the table leaves a fifth of each page free for that second version of each
-- row (unless the DBA has set a fill factor of their own). On this machine: a fifth less
-- WAL per claim and completion, 6-25 % more of them a second (docs/performance.md).
DROP INDEX IF EXISTS {schema}.records_response;
CREATE INDEX IF NOT EXISTS records_response_due ON {schema}.records (response_until)
    WHERE response_until > '-infinity';
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                   WHERE n.nspname = '{schema}' AND c.relname = 'records'
                     AND array_to_string(c.reloptions, ',') LIKE '%fillfactor=%') THEN
        ALTER TABLE {schema}.records SET (fillfactor = 80);
    END IF;
END $$;
-- Version 1's claim and inspect, whose arguments or answers changed (only theirs: a
-- function dropped and made again would break the statements other instances have
-- prepared on it).
DROP FUNCTION IF EXISTS {schema}.claim(text, bytea, bytea, bigint, bigint, bigint, bigint, integer);
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
               WHERE n.nspname = '{schema}' AND p.proname = 'inspect'
                 AND NOT ('spent' = ANY (p.proargnames))) THEN
        DROP FUNCTION {schema}.inspect(text);
    END IF;
END $$;

-- How many records each scope holds, in 16 counters per scope so that one tenant's
-- claims do not all wait on one row; kept by the trigger below (every insert, delete
-- and change of scope), expired records counted until the sweeper deletes them.
CREATE TABLE IF NOT EXISTS {schema}.shares (
    scope bigint NOT NULL,
    slot smallint NOT NULL,
    records bigint NOT NULL,
    PRIMARY KEY (scope, slot)
);

CREATE OR REPLACE FUNCTION {schema}.count_share() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('DELETE', 'UPDATE') AND OLD.scope IS NOT NULL THEN
        INSERT INTO {schema}.shares AS s (scope, slot, records)
        VALUES (OLD.scope, abs(hashtext(OLD.key)) % 16, -1)
        ON CONFLICT (scope, slot) DO UPDATE SET records = s.records - 1;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') AND NEW.scope IS NOT NULL THEN
        INSERT INTO {schema}.shares AS s (scope, slot, records)
        VALUES (NEW.scope, abs(hashtext(NEW.key)) % 16, 1)
        ON CONFLICT (scope, slot) DO UPDATE SET records = s.records + 1;
    END IF;
    RETURN NULL;
END $$;

-- Only records with a scope fire it: a route without one pays nothing for shares (on
-- this machine the trigger cost a fifth of a claim and complete's throughput).
DROP TRIGGER IF EXISTS records_share ON {schema}.records;
DROP TRIGGER IF EXISTS records_share_insert ON {schema}.records;
CREATE TRIGGER records_share_insert
    AFTER INSERT ON {schema}.records
    FOR EACH ROW WHEN (NEW.scope IS NOT NULL) EXECUTE FUNCTION {schema}.count_share();
DROP TRIGGER IF EXISTS records_share_delete ON {schema}.records;
CREATE TRIGGER records_share_delete
    AFTER DELETE ON {schema}.records
    FOR EACH ROW WHEN (OLD.scope IS NOT NULL) EXECUTE FUNCTION {schema}.count_share();
DROP TRIGGER IF EXISTS records_share_update ON {schema}.records;
CREATE TRIGGER records_share_update
    AFTER UPDATE OF scope ON {schema}.records
    FOR EACH ROW WHEN (OLD.scope IS DISTINCT FROM NEW.scope) EXECUTE FUNCTION {schema}.count_share();

-- Milliseconds from now_ until then (negative once it has passed).
-- A dropped response's response_until is -infinity: long past, -1 ms.
CREATE OR REPLACE FUNCTION {schema}.ms(then_ timestamptz, now_ timestamptz) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN then_ = '-infinity' THEN -1 ELSE floor(extract(epoch FROM then_ - now_) * 1000)::bigint END
$$;

-- claim: creates an in-flight record for the claimant if the key holds no live record
-- (an expired one is taken over), else returns the record there. The record lives
-- p_remember_ms; its response, p_retention_ms from now (where that is shorter).
--
-- code 1: acquired (also when the record found is the claimant's own claim); 0: the
-- record found, in the other columns (times as milliseconds from now; spent: a
-- completed record past its retention, its headers and body not returned, completed_ms
-- its completion time in ms since the epoch); -4: the scope holds p_scope_max records
-- (retry_ms: until its first expires); -5: fewer than p_min_acks synchronous standbys
-- are streaming (nothing written).
CREATE OR REPLACE FUNCTION {schema}.claim(
    p_key text, p_owner bytea, p_fingerprint bytea, p_retention_ms bigint, p_remember_ms bigint,
    p_lease_ms bigint, p_scope bigint, p_scope_max bigint, p_min_acks integer,
    OUT code integer, OUT fingerprint bytea, OUT state text, OUT owner bytea, OUT lease_ms bigint,
    OUT status smallint, OUT headers bytea, OUT body bytea, OUT reason text,
    OUT due_ms bigint, OUT give_up_ms bigint, OUT retry_ms bigint, OUT spent boolean,
    OUT completed_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz := clock_timestamp();
    r {schema}.records;
BEGIN
    SELECT * INTO r FROM {schema}.records WHERE records.key = p_key AND records.expires_at > now_;
    IF NOT FOUND THEN
        IF p_min_acks > 0 AND (SELECT count(*) FROM pg_stat_replication
                               WHERE sync_state IN ('sync', 'quorum')) < p_min_acks THEN
            code := -5;
            RETURN;
        END IF;
        IF p_scope IS NOT NULL AND (SELECT coalesce(sum(s.records), 0) FROM {schema}.shares s
                                    WHERE s.scope = p_scope) >= p_scope_max THEN
            code := -4;
            retry_ms := greatest((SELECT {schema}.ms(min(x.expires_at), now_) FROM {schema}.records x
                                  WHERE x.scope = p_scope), 1000);
            RETURN;
        END IF;
        INSERT INTO {schema}.records AS x (key, fingerprint, state, owner, expires_at, lease_until, scope,
                                           response_until)
        VALUES (p_key, p_fingerprint, 'in_flight', p_owner,
                now_ + greatest(p_remember_ms, p_retention_ms) * interval '1 ms',
                now_ + p_lease_ms * interval '1 ms', p_scope,
                CASE WHEN p_remember_ms > p_retention_ms THEN now_ + p_retention_ms * interval '1 ms' END)
        ON CONFLICT (key) DO UPDATE SET
            fingerprint = excluded.fingerprint, state = 'in_flight', owner = excluded.owner,
            expires_at = excluded.expires_at, lease_until = excluded.lease_until, status = NULL,
            headers = NULL, body = NULL, reason = NULL, probe_due = NULL, probe_give_up = NULL,
            scope = excluded.scope, waited = false, response_until = excluded.response_until,
            completed_at = NULL
        WHERE x.expires_at <= now_;
        IF FOUND THEN
            code := 1;
            RETURN;
        END IF;
        -- Another claim of the key committed first: what it wrote is the record.
        SELECT * INTO r FROM {schema}.records WHERE records.key = p_key AND records.expires_at > now_;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'idemproxy: the record claimed at once by another vanished'
                USING ERRCODE = '40001';
        END IF;
    END IF;
    IF r.state = 'in_flight' AND r.owner = p_owner AND r.lease_until > now_ THEN
        code := 1;
        RETURN;
    END IF;
    code := 0;
    fingerprint := r.fingerprint;
    state := r.state;
    owner := r.owner;
    lease_ms := {schema}.ms(r.lease_until, now_);
    status := r.status;
    spent := r.state = 'completed' AND r.response_until <= now_;
    IF NOT coalesce(spent, false) THEN
        headers := r.headers;
        body := r.body;
    END IF;
    completed_ms := floor(extract(epoch FROM r.completed_at) * 1000)::bigint;
    reason := r.reason;
    due_ms := {schema}.ms(r.probe_due, now_);
    give_up_ms := {schema}.ms(r.probe_give_up, now_);
END $$;

-- Version 4. take_claim: the insert of an unscoped claim, over an expired record,
-- where no standby is waited for. The plain claim statement (claim_plain in
-- src/store/postgres.rs) reads the live record and calls this only where there is
-- none, so that a replay's statement is a read with no insert in its plan (one with a
-- data-modifying CTE cost a replay half of Postgres's rate on this machine,
-- docs/performance.md). True when the claimant's record was written; false when
-- another claim of the key committed first (its record is live: the statement runs
-- again to read it). Times are the client statement's start, as the statement's are.
CREATE OR REPLACE FUNCTION {schema}.take_claim(p_key text, p_owner bytea, p_fingerprint bytea,
                                               p_retention_ms bigint, p_remember_ms bigint,
                                               p_lease_ms bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {schema}.records AS x (key, fingerprint, state, owner, expires_at, lease_until, response_until)
    VALUES (p_key, p_fingerprint, 'in_flight', p_owner,
            statement_timestamp() + greatest(p_remember_ms, p_retention_ms) * interval '1 ms',
            statement_timestamp() + p_lease_ms * interval '1 ms',
            CASE WHEN p_remember_ms > p_retention_ms
                 THEN statement_timestamp() + p_retention_ms * interval '1 ms' END)
    ON CONFLICT (key) DO UPDATE SET
        fingerprint = excluded.fingerprint, state = 'in_flight', owner = excluded.owner,
        expires_at = excluded.expires_at, lease_until = excluded.lease_until, status = NULL,
        headers = NULL, body = NULL, reason = NULL, probe_due = NULL, probe_give_up = NULL,
        scope = NULL, waited = false, response_until = excluded.response_until, completed_at = NULL
    WHERE x.expires_at <= statement_timestamp();
    RETURN FOUND;
END $$;

-- complete: records the response on the claimant's in-flight record while its lease
-- holds. Returns 1 when completed, 0 when fenced off. The expiry is kept.
CREATE OR REPLACE FUNCTION {schema}.complete(p_key text, p_owner bytea, p_status smallint,
                                             p_headers bytea, p_body bytea) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz := clock_timestamp();
    told boolean;
BEGIN
    UPDATE {schema}.records SET state = 'completed', owner = NULL, lease_until = NULL,
        status = p_status, headers = p_headers, body = p_body, completed_at = now_
    WHERE key = p_key AND state = 'in_flight' AND owner = p_owner AND lease_until > now_
        AND expires_at > now_
    RETURNING waited INTO told;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    IF told THEN
        PERFORM pg_notify('{channel}', p_key);
    END IF;
    RETURN 1;
END $$;

-- mark_unknown: the claimant forwarded its request and could not learn the outcome.
-- Fenced on the owner and the in-flight state (not the lease: a lapsed lease already
-- reads as unknown, and this says why). The owner is kept, for a resolution to be
-- fenced on. Returns 1, or 0 when fenced off.
CREATE OR REPLACE FUNCTION {schema}.mark_unknown(p_key text, p_owner bytea, p_reason text,
                                                 p_first_after_ms bigint, p_give_up_after_ms bigint)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz := clock_timestamp();
    told boolean;
BEGIN
    UPDATE {schema}.records SET state = 'unknown', lease_until = NULL, reason = p_reason,
        probe_due = now_ + p_first_after_ms * interval '1 ms',
        probe_give_up = now_ + p_give_up_after_ms * interval '1 ms'
    WHERE key = p_key AND state = 'in_flight' AND owner = p_owner AND expires_at > now_
    RETURNING waited INTO told;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    IF told THEN
        PERFORM pg_notify('{channel}', p_key);
    END IF;
    RETURN 1;
END $$;

-- release: removes an in-flight claim whose request never reached the upstream; only
-- its owner may. Returns 1, or 0 when fenced off.
CREATE OR REPLACE FUNCTION {schema}.release(p_key text, p_owner bytea) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    told boolean;
BEGIN
    DELETE FROM {schema}.records
    WHERE key = p_key AND state = 'in_flight' AND owner = p_owner AND expires_at > clock_timestamp()
    RETURNING waited INTO told;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    IF told THEN
        PERFORM pg_notify('{channel}', p_key);
    END IF;
    RETURN 1;
END $$;

-- resolve: what was learned of an unknown record (marked so, or in flight past its
-- lease) settles it: applied, the response becomes its record; not applied (p_status
-- NULL), it is removed and the next retry runs. Given p_owner, only for that claim.
-- Returns 1 resolved, 0 not unknown, -2 unknown for another claim, -1 no record.
CREATE OR REPLACE FUNCTION {schema}.resolve(p_key text, p_owner bytea, p_status smallint,
                                            p_headers bytea, p_body bytea) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz := clock_timestamp();
    r {schema}.records;
BEGIN
    SELECT * INTO r FROM {schema}.records WHERE key = p_key AND expires_at > now_ FOR UPDATE;
    IF NOT FOUND THEN
        RETURN -1;
    END IF;
    IF NOT (r.state = 'unknown' OR (r.state = 'in_flight' AND r.lease_until <= now_)) THEN
        RETURN 0;
    END IF;
    IF p_owner IS NOT NULL AND r.owner IS DISTINCT FROM p_owner THEN
        RETURN -2;
    END IF;
    IF p_status IS NULL THEN
        DELETE FROM {schema}.records WHERE key = p_key;
    ELSE
        UPDATE {schema}.records SET state = 'completed', owner = NULL, lease_until = NULL,
            status = p_status, headers = p_headers, body = p_body, reason = NULL,
            probe_due = NULL, probe_give_up = NULL, completed_at = now_
        WHERE key = p_key;
    END IF;
    IF r.waited THEN
        PERFORM pg_notify('{channel}', p_key);
    END IF;
    RETURN 1;
END $$;

-- begin_probe: takes the probe lease of an unknown record whose probe is due, so that
-- one caller asks the upstream. A record in flight past its lease becomes unknown for
-- lease-expired, its owner kept; one with no probe scheduled is scheduled from now.
-- code 1: leased, for the claim owner; 2: not due for wait_ms; -3: given up; 0:
-- nothing to probe; -1: no record.
CREATE OR REPLACE FUNCTION {schema}.begin_probe(p_key text, p_lease_ms bigint, p_give_up_after_ms bigint,
                                                OUT code integer, OUT owner bytea, OUT wait_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz := clock_timestamp();
    r {schema}.records;
BEGIN
    wait_ms := 0;
    SELECT * INTO r FROM {schema}.records WHERE key = p_key AND expires_at > now_ FOR UPDATE;
    IF NOT FOUND THEN
        code := -1;
        RETURN;
    END IF;
    IF r.state = 'in_flight' THEN
        IF r.lease_until > now_ THEN
            code := 0;
            RETURN;
        END IF;
        UPDATE {schema}.records SET state = 'unknown', lease_until = NULL, reason = 'lease-expired',
            probe_due = now_ + p_lease_ms * interval '1 ms',
            probe_give_up = now_ + p_give_up_after_ms * interval '1 ms'
        WHERE key = p_key;
        code := 1;
        owner := r.owner;
        RETURN;
    END IF;
    IF r.state <> 'unknown' OR r.owner IS NULL THEN
        code := 0;
        RETURN;
    END IF;
    IF r.probe_give_up IS NULL THEN
        UPDATE {schema}.records SET probe_due = now_ + p_lease_ms * interval '1 ms',
            probe_give_up = now_ + p_give_up_after_ms * interval '1 ms'
        WHERE key = p_key;
        code := 1;
        owner := r.owner;
        RETURN;
    END IF;
    IF r.probe_due IS NULL THEN
        code := -3;
        RETURN;
    END IF;
    IF r.probe_due > now_ THEN
        code := 2;
        wait_ms := {schema}.ms(r.probe_due, now_);
        RETURN;
    END IF;
    IF r.probe_give_up <= now_ THEN
        UPDATE {schema}.records SET probe_due = NULL WHERE key = p_key;
        code := -3;
        RETURN;
    END IF;
    UPDATE {schema}.records SET probe_due = now_ + p_lease_ms * interval '1 ms' WHERE key = p_key;
    code := 1;
    owner := r.owner;
END $$;

-- defer_probe: the probe learned nothing; the next is due p_every_ms from now, unless
-- that is past its give-up time (then it has given up). Only while the record is
-- unknown for the claim p_owner made. Returns 1 scheduled, -3 given up, 0 settled.
CREATE OR REPLACE FUNCTION {schema}.defer_probe(p_key text, p_owner bytea, p_every_ms bigint) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz := clock_timestamp();
    r {schema}.records;
BEGIN
    SELECT * INTO r FROM {schema}.records WHERE key = p_key AND expires_at > now_ FOR UPDATE;
    IF NOT FOUND OR r.state <> 'unknown' OR r.owner IS DISTINCT FROM p_owner OR r.probe_give_up IS NULL THEN
        RETURN 0;
    END IF;
    IF r.probe_due IS NULL OR now_ + p_every_ms * interval '1 ms' >= r.probe_give_up THEN
        UPDATE {schema}.records SET probe_due = NULL WHERE key = p_key;
        RETURN -3;
    END IF;
    UPDATE {schema}.records SET probe_due = now_ + p_every_ms * interval '1 ms' WHERE key = p_key;
    RETURN 1;
END $$;

-- inspect: what a live record holds, its body's length instead of its body (spent: a
-- completed record past its retention, as claim says it).
CREATE OR REPLACE FUNCTION {schema}.inspect(p_key text,
    OUT fingerprint bytea, OUT state text, OUT owner bytea, OUT ttl_ms bigint, OUT lease_ms bigint,
    OUT status smallint, OUT headers bytea, OUT body_length bigint, OUT reason text,
    OUT due_ms bigint, OUT give_up_ms bigint, OUT spent boolean, OUT completed_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz := clock_timestamp();
BEGIN
    SELECT r.fingerprint, r.state, r.owner, {schema}.ms(r.expires_at, now_), {schema}.ms(r.lease_until, now_),
           r.status, r.headers, length(r.body), r.reason, {schema}.ms(r.probe_due, now_),
           {schema}.ms(r.probe_give_up, now_), r.state = 'completed' AND r.response_until <= now_,
           floor(extract(epoch FROM r.completed_at) * 1000)::bigint
    INTO fingerprint, state, owner, ttl_ms, lease_ms, status, headers, body_length, reason, due_ms, give_up_ms,
         spent, completed_ms
    FROM {schema}.records r WHERE r.key = p_key AND r.expires_at > now_;
END $$;

-- watch: a waiter on another connection asks to be told when this in-flight claim
-- changes (complete, mark_unknown, release and resolve then notify '{channel}').
CREATE OR REPLACE FUNCTION {schema}.watch(p_key text) RETURNS integer
LANGUAGE sql AS $$
    WITH marked AS (
        UPDATE {schema}.records SET waited = true
        WHERE key = p_key AND state = 'in_flight' AND NOT waited AND expires_at > clock_timestamp()
        RETURNING 1)
    SELECT count(*)::integer FROM marked
$$;

-- sweep: deletes up to p_batch expired records, and drops up to p_batch responses
-- past their retention (their records kept until remember ends), skipping rows
-- another sweeper or a claim holds, so that no statement holds many locks or holds
-- them long. Returns the larger of the two counts: at p_batch, more may be left. Its
-- time is the statement's start (stable, so that it bounds the index scans: with
-- clock_timestamp(), each sweep read every entry of both indexes when nothing was due,
-- 26 ms a second at 53,000 records).
CREATE OR REPLACE FUNCTION {schema}.sweep(p_batch integer) RETURNS integer
LANGUAGE sql AS $$
    WITH dropped AS (
        UPDATE {schema}.records SET headers = NULL, body = NULL, response_until = '-infinity' WHERE key IN (
            SELECT key FROM {schema}.records
            WHERE response_until > '-infinity' AND response_until <= statement_timestamp()
            LIMIT p_batch FOR UPDATE SKIP LOCKED)
        RETURNING 1),
    gone AS (
        DELETE FROM {schema}.records WHERE key IN (
            SELECT key FROM {schema}.records WHERE expires_at <= statement_timestamp()
            ORDER BY expires_at LIMIT p_batch FOR UPDATE SKIP LOCKED)
        RETURNING 1)
    SELECT greatest((SELECT count(*) FROM dropped), (SELECT count(*) FROM gone))::integer
$$;
