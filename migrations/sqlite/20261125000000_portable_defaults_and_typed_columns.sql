-- Services write this table with their own SQLite library, often the one
-- their system ships (Debian 12 and its Python: 3.40). The first schema's
-- created_at default used unixepoch('subsec'), which SQLite before 3.42
-- evaluates to NULL: every INSERT that left created_at out failed with
-- "NOT NULL constraint failed". julianday('now') has millisecond precision
-- and works on every SQLite version. A default cannot be altered in place,
-- so the table is rebuilt (SQLite's documented procedure: new table, copy,
-- drop, rename, then its indexes and triggers again). The copy holds the
-- write lock, and services' inserts wait, for as long as it takes: on a
-- large outbox, run it with the relay stopped, after retention trimmed it.
CREATE TABLE switchyard_outbox_rebuilt (
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
    created_at       INTEGER NOT NULL DEFAULT (CAST(round((julianday('now') - 2440587.5) * 86400000) AS INTEGER)),
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

INSERT INTO switchyard_outbox_rebuilt
SELECT id, event_id, aggregate_type, aggregate_id, event_type, payload, payload_bytes, headers,
       tenant, created_at, not_before, status, attempts, next_attempt_at, lease_owner, lease_id,
       lease_expires_at, published_at, last_error, deliveries, plugin_version
  FROM switchyard_outbox;

-- AUTOINCREMENT never hands out an id twice, even when the highest rows were
-- deleted (published_rows = "delete", retention): carry the counter over.
INSERT INTO sqlite_sequence (name, seq)
SELECT 'switchyard_outbox_rebuilt', 0
 WHERE NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'switchyard_outbox_rebuilt');
UPDATE sqlite_sequence
   SET seq = (SELECT max(seq) FROM sqlite_sequence
               WHERE name IN ('switchyard_outbox', 'switchyard_outbox_rebuilt'))
 WHERE name = 'switchyard_outbox_rebuilt';

DROP TABLE switchyard_outbox;
ALTER TABLE switchyard_outbox_rebuilt RENAME TO switchyard_outbox;

CREATE INDEX switchyard_outbox_claim_idx
    ON switchyard_outbox (id)
    WHERE status IN ('pending', 'in_flight');
CREATE INDEX switchyard_outbox_aggregate_idx
    ON switchyard_outbox (aggregate_type, aggregate_id, id)
    WHERE status <> 'published';
CREATE INDEX switchyard_outbox_published_idx
    ON switchyard_outbox (published_at)
    WHERE status = 'published';
CREATE INDEX switchyard_outbox_dead_idx
    ON switchyard_outbox (id)
    WHERE status = 'dead';

CREATE TRIGGER switchyard_outbox_event_id_is_uuid
BEFORE INSERT ON switchyard_outbox
WHEN NEW.event_id NOT GLOB '[0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F]-[0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F]-[0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F]-[0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F]-[0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F]'
BEGIN
    SELECT RAISE(ABORT, 'switchyard_outbox.event_id must be a UUID (8-4-4-4-12 hex digits)');
END;
CREATE TRIGGER switchyard_outbox_aggregate_keys_bounded
BEFORE INSERT ON switchyard_outbox
WHEN length(CAST(NEW.aggregate_id AS BLOB)) > 1024 OR length(CAST(NEW.aggregate_type AS BLOB)) > 255
BEGIN
    SELECT RAISE(ABORT, 'switchyard_outbox.aggregate_id must be at most 1024 bytes and aggregate_type at most 255 bytes');
END;

-- SQLite stores what it is given whatever the column's type. A value of the
-- wrong type (an ISO date in created_at, bytes in headers) is refused here,
-- where the service can still fix it, as PostgreSQL's column types refuse it.
CREATE TRIGGER switchyard_outbox_times_are_ms
BEFORE INSERT ON switchyard_outbox
WHEN typeof(NEW.created_at) <> 'integer'
  OR (NEW.not_before IS NOT NULL AND typeof(NEW.not_before) <> 'integer')
BEGIN
    SELECT RAISE(ABORT, 'switchyard_outbox.created_at and not_before must be INTEGER milliseconds since the Unix epoch (leave created_at out for the current time)');
END;
CREATE TRIGGER switchyard_outbox_headers_are_json
BEFORE INSERT ON switchyard_outbox
WHEN typeof(NEW.headers) <> 'text' OR NOT json_valid(NEW.headers)
BEGIN
    SELECT RAISE(ABORT, 'switchyard_outbox.headers must be a JSON object as TEXT, e.g. {"traceparent": "00-..."}');
END;
CREATE TRIGGER switchyard_outbox_payloads_typed
BEFORE INSERT ON switchyard_outbox
WHEN (NEW.payload IS NOT NULL AND typeof(NEW.payload) <> 'text')
  OR (NEW.payload_bytes IS NOT NULL AND typeof(NEW.payload_bytes) <> 'blob')
  OR typeof(NEW.aggregate_type) <> 'text' OR typeof(NEW.aggregate_id) <> 'text'
  OR typeof(NEW.event_type) <> 'text'
  OR (NEW.tenant IS NOT NULL AND typeof(NEW.tenant) <> 'text')
BEGIN
    SELECT RAISE(ABORT, 'switchyard_outbox: payload must be JSON as TEXT, payload_bytes a BLOB, and aggregate_type, aggregate_id, event_type and tenant TEXT');
END;
