-- The outbox table written by services and drained by Switchyard.
--
-- Services insert rows (event columns only) in the same transaction as their
-- business data. Everything from `status` on belongs to the relay.
CREATE TABLE switchyard_outbox (
    id               BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id         UUID        NOT NULL DEFAULT gen_random_uuid(),
    aggregate_type   TEXT        NOT NULL,
    aggregate_id     TEXT        NOT NULL,
    event_type       TEXT        NOT NULL,
    -- JSON payload; a binary event sets payload_bytes instead.
    payload          JSONB,
    payload_bytes    BYTEA,
    -- String-valued headers, e.g. {"traceparent": "00-..."}.
    headers          JSONB       NOT NULL DEFAULT '{}'::jsonb,
    tenant           TEXT,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- Set by the writer to delay an event.
    not_before       TIMESTAMPTZ,

    -- Relay state.
    -- pending: waiting for a claim (first try or retry, see next_attempt_at)
    -- in_flight: leased by lease_owner until lease_expires_at
    -- published: every target acknowledged (or the plugin dropped it)
    -- dead: dead-lettered, see last_error
    status           TEXT        NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'in_flight', 'published', 'dead')),
    attempts         INTEGER     NOT NULL DEFAULT 0,
    next_attempt_at  TIMESTAMPTZ NOT NULL DEFAULT '-infinity',
    lease_owner      TEXT,
    -- A fresh token per claim: an ack must present it, so a worker whose lease
    -- expired and was re-claimed elsewhere cannot ack or fail the row.
    lease_id         UUID,
    lease_expires_at TIMESTAMPTZ,
    published_at     TIMESTAMPTZ,
    last_error       TEXT,
    -- Per-target delivery state: {"<delivery key>": {"target": .., "topic": .., "acked_at": ..}}
    deliveries       JSONB       NOT NULL DEFAULT '{}'::jsonb,
    -- Content hash of the plugin version that last routed the row.
    plugin_version   TEXT,
    CONSTRAINT switchyard_outbox_event_id_key UNIQUE (event_id)
);

-- Claim scan: unfinished rows in id order. Published and dead rows leave the
-- index, so its size tracks the backlog, not the table.
CREATE INDEX switchyard_outbox_claim_idx
    ON switchyard_outbox (id)
    WHERE status IN ('pending', 'in_flight');

-- Head-of-line check: "is there an earlier unfinished row of this aggregate?"
-- Dead rows stay in it so that `hold` mode can keep an aggregate waiting.
CREATE INDEX switchyard_outbox_aggregate_idx
    ON switchyard_outbox (aggregate_type, aggregate_id, id)
    WHERE status <> 'published';

-- Dead-letter listing and retention.
CREATE INDEX switchyard_outbox_dead_idx
    ON switchyard_outbox (id)
    WHERE status = 'dead';
CREATE INDEX switchyard_outbox_published_idx
    ON switchyard_outbox (published_at)
    WHERE status = 'published';

-- Wake the relay at commit. One notification per inserting statement, and
-- PostgreSQL folds identical notifications within a transaction.
CREATE FUNCTION switchyard_outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('switchyard_outbox', '');
    RETURN NULL;
END;
$$;

CREATE TRIGGER switchyard_outbox_notify
    AFTER INSERT ON switchyard_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION switchyard_outbox_notify();
