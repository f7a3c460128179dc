-- The ack in one call. At the rates services write, each event is its own
-- batch, and the ack's transaction (BEGIN with its planner settings, the
-- outcomes, the unpark, COMMIT) was four round trips: each one wakes a
-- server process, which cost the database more than the statements. Called
-- as one statement, it is one.
--
-- The function keeps the two steps apart: it is VOLATILE, so in READ
-- COMMITTED the unpark takes a snapshot of its own after the outcomes are
-- written. A claim that parked a row behind one of these rows held that row
-- FOR SHARE, so writing the outcome waited for the claim to commit, and the
-- unpark sees the row it parked. One snapshot for both would not.
--
-- Its SET clauses plan each statement once per session, with index probes
-- only: a custom plan per call cost more than the statement (0.3 ms for the
-- unpark), and a generic plan made while the outbox was nearly empty may
-- scan it whole on every ack as it grows.
--
-- `published_rows` is 'keep', 'delete' or 'archive'; `waiting` holds each
-- row's paused targets joined by chr(31), NULL for none. Returns the ids of
-- the rows recorded: one whose lease was lost is left alone. A later
-- migration that changes the outbox or archive columns replaces this.
CREATE FUNCTION switchyard_ack(
    p_ids bigint[], p_statuses text[], p_backoff_ms bigint[], p_errors text[],
    p_deliveries text[], p_plugin_versions text[], p_refunds bool[], p_lease uuid,
    p_waiting text[], p_published_rows text)
RETURNS bigint[]
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    acked bigint[];
    freed_types text[];
    freed_ids text[];
    unparked bigint;
BEGIN
    -- One statement for the three ways of keeping a published row; the
    -- conditions on `p_published_rows` are decided once per call.
    WITH d AS MATERIALIZED (
        SELECT * FROM unnest(p_ids, p_statuses, p_backoff_ms, p_errors, p_deliveries,
                             p_plugin_versions, p_refunds, p_waiting)
               AS d(id, status, backoff_ms, error, deliveries, plugin_version, refund, waiting)
    ), gone AS (
        DELETE FROM switchyard_outbox o USING d
         WHERE p_published_rows <> 'keep'
           AND o.id = d.id AND d.status = 'published'
           AND o.status = 'in_flight' AND o.lease_id = p_lease
        RETURNING o.*, d.deliveries AS new_deliveries, d.plugin_version AS new_plugin_version
    ), archived AS (
        INSERT INTO switchyard_outbox_archive
               (id, event_id, aggregate_type, aggregate_id, event_type, payload, payload_bytes,
                headers, tenant, created_at, attempts, published_at, deliveries, plugin_version)
        SELECT id, event_id, aggregate_type, aggregate_id, event_type, payload, payload_bytes,
               headers, tenant, created_at, attempts, now(), new_deliveries::jsonb,
               COALESCE(new_plugin_version, plugin_version)
          FROM gone
         WHERE p_published_rows = 'archive'
    ), kept AS (
        UPDATE switchyard_outbox o
           SET status = d.status,
               published_at = CASE WHEN d.status = 'published' THEN now() ELSE NULL END,
               next_attempt_at = CASE WHEN d.status = 'pending'
                                      THEN now() + d.backoff_ms * interval '1 millisecond'
                                      ELSE o.next_attempt_at END,
               last_error = d.error,
               attempts = o.attempts - CASE WHEN d.refund THEN 1 ELSE 0 END,
               deliveries = d.deliveries::jsonb,
               plugin_version = COALESCE(d.plugin_version, o.plugin_version),
               lease_owner = NULL,
               lease_id = NULL,
               lease_expires_at = NULL,
               waiting_on = string_to_array(d.waiting, chr(31))
          FROM d
         WHERE (p_published_rows = 'keep' OR d.status <> 'published')
           AND o.id = d.id AND o.status = 'in_flight' AND o.lease_id = p_lease
        RETURNING o.id, o.status, o.aggregate_type, o.aggregate_id, d.waiting IS NOT NULL AS waits
    ), done AS (
        SELECT id, 'published' AS status, aggregate_type, aggregate_id, false AS waits FROM gone
        UNION ALL SELECT * FROM kept
    )
    SELECT array_agg(id),
           array_agg(aggregate_type) FILTER (WHERE status <> 'pending' OR waits),
           array_agg(aggregate_id) FILTER (WHERE status <> 'pending' OR waits)
      INTO acked, freed_types, freed_ids
      FROM done;

    IF freed_types IS NOT NULL THEN
        -- The first parked row of each aggregate whose row finished goes
        -- back to the queue; if another is still unfinished, the next claim
        -- parks it again behind that one.
        UPDATE switchyard_outbox o
           SET status = 'pending'
         WHERE o.id = ANY (ARRAY(
               SELECT LEAST(
                        (SELECT p.id FROM switchyard_outbox p
                          WHERE p.aggregate_type = f.t AND p.aggregate_id = f.i AND p.queue = 2
                          ORDER BY p.id LIMIT 1),
                        (SELECT p.id FROM switchyard_outbox p
                          WHERE p.aggregate_type = f.t AND p.aggregate_id = f.i AND p.queue = 3
                          ORDER BY p.id LIMIT 1))
                 FROM (SELECT DISTINCT t, i FROM unnest(freed_types, freed_ids) AS f(t, i)) f
                -- Evaluated once: most of the time nothing is parked anywhere.
                WHERE EXISTS (SELECT 1 FROM switchyard_outbox WHERE queue = 2)
                   OR EXISTS (SELECT 1 FROM switchyard_outbox WHERE queue = 3)))
           AND o.queue IN (2, 3);
        GET DIAGNOSTICS unparked = ROW_COUNT;
        -- A freed row is announced at commit like a new one.
        IF unparked > 0 THEN
            PERFORM pg_notify('switchyard_outbox', '');
        END IF;
    END IF;
    RETURN COALESCE(acked, '{}');
END;
$$;
