-- Published rows moved out of the outbox by retention in `archive` mode
-- (times in ms since the Unix epoch, as in the outbox).
CREATE TABLE switchyard_outbox_archive (
    id             INTEGER PRIMARY KEY,
    event_id       TEXT    NOT NULL,
    aggregate_type TEXT    NOT NULL,
    aggregate_id   TEXT    NOT NULL,
    event_type     TEXT    NOT NULL,
    payload        TEXT,
    payload_bytes  BLOB,
    headers        TEXT    NOT NULL,
    tenant         TEXT,
    created_at     INTEGER NOT NULL,
    attempts       INTEGER NOT NULL,
    published_at   INTEGER,
    deliveries     TEXT    NOT NULL,
    plugin_version TEXT,
    archived_at    INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
);

CREATE INDEX switchyard_outbox_archive_archived_idx
    ON switchyard_outbox_archive (archived_at);

CREATE INDEX switchyard_outbox_dead_idx
    ON switchyard_outbox (id)
    WHERE status = 'dead';
