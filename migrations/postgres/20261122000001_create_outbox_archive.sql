-- Published rows moved out of the outbox by retention in `archive` mode.
-- The relay's lease columns are not kept; everything else is as it was when
-- the row was published.
CREATE TABLE switchyard_outbox_archive (
    id             BIGINT      PRIMARY KEY,
    event_id       UUID        NOT NULL,
    aggregate_type TEXT        NOT NULL,
    aggregate_id   TEXT        NOT NULL,
    event_type     TEXT        NOT NULL,
    payload        JSONB,
    payload_bytes  BYTEA,
    headers        JSONB       NOT NULL,
    tenant         TEXT,
    created_at     TIMESTAMPTZ NOT NULL,
    attempts       INTEGER     NOT NULL,
    published_at   TIMESTAMPTZ,
    deliveries     JSONB       NOT NULL,
    plugin_version TEXT,
    archived_at    TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- For whoever trims the archive in turn.
CREATE INDEX switchyard_outbox_archive_archived_idx
    ON switchyard_outbox_archive (archived_at);

-- Dead-letter filters by event type (`dlq list --event-type`, `status`).
CREATE INDEX switchyard_outbox_dead_type_idx
    ON switchyard_outbox (event_type, id)
    WHERE status = 'dead';
