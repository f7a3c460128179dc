-- The ack's plan sets up only what the call uses. One statement served the
-- three ways of keeping a published row, so every call started a DELETE
-- and an archive INSERT beside its UPDATE, and the unpark's plan with its
-- subqueries, for an outbox where nothing was parked: about a fifth of the
-- call's time. Now published rows that go are removed by a statement of
-- their own, run only when they go, and the unpark runs only when a parked
-- row exists (two index probes say so).
--
-- Same arguments, same result, same steps as migration 20261202000000
-- (see there: why it is one call, why its statements plan once per
-- session with index probes only, why the unpark is a later statement).
-- The removal and the update touch different rows, so each may take its
-- own snapshot.
CREATE OR REPLACE FUNCTION switchyard_ack(
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
    removed bigint[];
    removed_types text[];
    removed_ids text[];
    acked bigint[];
    freed_types text[];
    freed_ids text[];
    unparked bigint;
BEGIN
    IF p_published_rows <> 'keep' THEN
        WITH d AS MATERIALIZED (
            SELECT * FROM unnest(p_ids, p_statuses, p_deliveries, p_plugin_versions)
                   AS d(id, status, deliveries, plugin_version)
             WHERE status = 'published'
        ), gone AS (
            DELETE FROM switchyard_outbox o USING d
             WHERE o.id = d.id AND o.status = 'in_flight' AND o.lease_id = p_lease
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
        )
        SELECT array_agg(id), array_agg(aggregate_type), array_agg(aggregate_id)
          INTO removed, removed_types, removed_ids
          FROM gone;
    END IF;

    WITH d AS MATERIALIZED (
        SELECT * FROM unnest(p_ids, p_statuses, p_backoff_ms, p_errors, p_deliveries,
                             p_plugin_versions, p_refunds, p_waiting)
               AS d(id, status, backoff_ms, error, deliveries, plugin_version, refund, waiting)
         WHERE p_published_rows = 'keep' OR status <> 'published'
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
         WHERE o.id = d.id AND o.status = 'in_flight' AND o.lease_id = p_lease
        RETURNING o.id, o.status, o.aggregate_type, o.aggregate_id, d.waiting IS NOT NULL AS waits
    )
    SELECT array_agg(id),
           array_agg(aggregate_type) FILTER (WHERE status <> 'pending' OR waits),
           array_agg(aggregate_id) FILTER (WHERE status <> 'pending' OR waits)
      INTO acked, freed_types, freed_ids
      FROM kept;
    -- A removed row was published: it frees its aggregate too.
    IF removed IS NOT NULL THEN
        acked := removed || COALESCE(acked, '{}');
        freed_types := removed_types || COALESCE(freed_types, '{}');
        freed_ids := removed_ids || COALESCE(freed_ids, '{}');
    END IF;

    -- Most of the time nothing is parked anywhere: two index probes, and
    -- the unpark's plan is not even started.
    IF freed_types IS NOT NULL
       AND (EXISTS (SELECT 1 FROM switchyard_outbox WHERE queue = 2)
            OR EXISTS (SELECT 1 FROM switchyard_outbox WHERE queue = 3)) THEN
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
                 FROM (SELECT DISTINCT t, i FROM unnest(freed_types, freed_ids) AS f(t, i)) f))
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
