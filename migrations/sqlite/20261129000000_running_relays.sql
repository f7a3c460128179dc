-- The relays running against this outbox (see the PostgreSQL migration of
-- the same name). Times in milliseconds since the epoch, as elsewhere.
CREATE TABLE IF NOT EXISTS switchyard_relays (
    instance_id   TEXT PRIMARY KEY,
    admin_address TEXT,
    started_at    INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    seen_at       INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
);
