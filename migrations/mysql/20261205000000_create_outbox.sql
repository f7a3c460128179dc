-- The outbox on MySQL 8.0 and MariaDB 10.6 and later (InnoDB): the same
-- columns, states and bounds as on PostgreSQL and SQLite.
--
-- Times: created_at and not_before, which services write, are TIMESTAMP:
-- stored in UTC and converted by each session's time_zone, so a writer
-- whose session runs in local time stores the right instant (a DATETIME
-- would store its wall clock). The relay's own times are DATETIME(6) it
-- writes in UTC (its sessions run at time_zone '+00:00').
--
-- aggregate_key is what orders an aggregate's events: a hash of its type
-- and id, so that the index is small whatever the ids' length (InnoDB
-- bounds a key to 3,072 bytes, and an id of 1,024 characters in utf8mb4
-- takes 4,096). Two aggregates with the same hash would only wait for one
-- another, never overtake. The ids themselves are TEXT bounded in bytes by
-- named checks, as on the other databases: a VARCHAR counts characters,
-- and a longer value would fail with "Data too long" naming no limit.
CREATE TABLE switchyard_outbox (
    id               BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    event_id         CHAR(36)     CHARACTER SET ascii NOT NULL DEFAULT (uuid()),
    aggregate_type   TEXT         NOT NULL,
    aggregate_id     TEXT         NOT NULL,
    event_type       VARCHAR(255) NOT NULL,
    payload          JSON,
    payload_bytes    LONGBLOB,
    headers          JSON         NOT NULL DEFAULT ('{}'),
    tenant           VARCHAR(255),
    created_at       TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    not_before       TIMESTAMP(6) NULL DEFAULT NULL,

    status           VARCHAR(16)  CHARACTER SET ascii NOT NULL DEFAULT 'pending',
    attempts         INT          NOT NULL DEFAULT 0,
    next_attempt_at  DATETIME(6)  NOT NULL DEFAULT '1970-01-01 00:00:00',
    lease_owner      VARCHAR(255),
    lease_id         CHAR(36)     CHARACTER SET ascii,
    lease_expires_at DATETIME(6),
    published_at     DATETIME(6),
    last_error       TEXT,
    deliveries       JSON         NOT NULL DEFAULT ('{}'),
    plugin_version   VARCHAR(255),
    waiting_on       JSON,
    aggregate_key    BINARY(16) AS (unhex(md5(concat(aggregate_type, char(0), aggregate_id)))) STORED,

    CONSTRAINT switchyard_outbox_event_id_unique UNIQUE (event_id),
    CONSTRAINT switchyard_outbox_event_id_is_uuid
        CHECK (event_id REGEXP '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$'),
    CONSTRAINT switchyard_outbox_aggregate_id_at_most_1024_bytes CHECK (octet_length(aggregate_id) <= 1024),
    CONSTRAINT switchyard_outbox_aggregate_type_at_most_255_bytes CHECK (octet_length(aggregate_type) <= 255),
    CONSTRAINT switchyard_outbox_status
        CHECK (status IN ('pending', 'in_flight', 'published', 'dead')),
    CONSTRAINT switchyard_outbox_payload_json CHECK (payload IS NULL OR json_valid(payload)),
    CONSTRAINT switchyard_outbox_headers_json CHECK (json_valid(headers)),

    -- Claims: pending rows in id order, in-flight rows whose lease ran out;
    -- dead letters in id order.
    INDEX switchyard_outbox_claim_idx (status, id),
    -- The head-of-aggregate check: an aggregate's unfinished earlier rows.
    INDEX switchyard_outbox_aggregate_idx (aggregate_key, status, id),
    -- Retention.
    INDEX switchyard_outbox_published_idx (published_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

-- Published rows moved out of the outbox by retention in `archive` mode.
CREATE TABLE switchyard_outbox_archive (
    id             BIGINT        NOT NULL PRIMARY KEY,
    event_id       CHAR(36)      CHARACTER SET ascii NOT NULL,
    aggregate_type TEXT          NOT NULL,
    aggregate_id   TEXT          NOT NULL,
    event_type     VARCHAR(255)  NOT NULL,
    payload        JSON,
    payload_bytes  LONGBLOB,
    headers        JSON          NOT NULL,
    tenant         VARCHAR(255),
    created_at     TIMESTAMP(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    attempts       INT           NOT NULL,
    published_at   DATETIME(6),
    deliveries     JSON          NOT NULL,
    plugin_version VARCHAR(255),
    archived_at    DATETIME(6)   NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    INDEX switchyard_outbox_archive_archived_idx (archived_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

-- The relays running against this outbox (see the PostgreSQL migration
-- 20261129000000_running_relays).
CREATE TABLE switchyard_relays (
    instance_id   VARCHAR(255) NOT NULL PRIMARY KEY,
    admin_address VARCHAR(255),
    started_at    DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    seen_at       DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

-- Which relay serves this database (see the PostgreSQL migration
-- 20261201000000_database_ownership).
CREATE TABLE switchyard_ownership (
    id         INT          NOT NULL PRIMARY KEY DEFAULT 1,
    owner      VARCHAR(255),
    token      BIGINT       NOT NULL DEFAULT 0,
    expires_at DATETIME(6)  NOT NULL DEFAULT '1970-01-01 00:00:00',
    CONSTRAINT switchyard_ownership_one_row CHECK (id = 1)
) ENGINE = InnoDB;
INSERT IGNORE INTO switchyard_ownership (id) VALUES (1);
