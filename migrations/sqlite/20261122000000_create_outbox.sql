-- The outbox table on SQLite, for the embedded default: the same columns and
-- states as the PostgreSQL schema. Times are milliseconds since the Unix
-- epoch (INTEGER), UUIDs and JSON are TEXT.
CREATE TABLE switchyard_outbox (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id         TEXT    NOT NULL UNIQUE DEFAULT (
        lower(hex(randomblob(4))) || '-' || lower(hex(randomblob(2))) || '-4' ||
        substr(lower(hex(randomblob(2))), 2) || '-' ||
        substr('89ab', 1 + (abs(random()) % 4), 1) || substr(lower(hex(randomblob(2))), 2) || '-' ||
        lower(hex(randomblob(6)))),
    aggregate_type   TEXT    NOT NULL,
    aggregate_id     TEXT    NOT NULL,
    event_type       TEXT    NOT NULL,
    payload          TEXT    CHECK (payload IS NULL OR json_valid(payload)),
    payload_bytes    BLOB,
    headers          TEXT    NOT NULL DEFAULT '{}',
    tenant           TEXT,
    created_at       INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    not_before       INTEGER,

    status           TEXT    NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'in_flight', 'published', 'dead')),
    attempts         INTEGER NOT NULL DEFAULT 0,
    next_attempt_at  INTEGER NOT NULL DEFAULT 0,
    lease_owner      TEXT,
    lease_id         TEXT,
    lease_expires_at INTEGER,
    published_at     INTEGER,
    last_error       TEXT,
    deliveries       TEXT    NOT NULL DEFAULT '{}',
    plugin_version   TEXT
);

CREATE INDEX switchyard_outbox_claim_idx
    ON switchyard_outbox (id)
    WHERE status IN ('pending', 'in_flight');

CREATE INDEX switchyard_outbox_aggregate_idx
    ON switchyard_outbox (aggregate_type, aggregate_id, id)
    WHERE status <> 'published';

CREATE INDEX switchyard_outbox_published_idx
    ON switchyard_outbox (published_at)
    WHERE status = 'published';
