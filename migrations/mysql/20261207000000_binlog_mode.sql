-- Binlog mode: rows a writer inserts while the table is set up for it are
-- `streamed` (read from the binary log, never claimed), and each binlog
-- reader keeps its MariaDB GTID position here, for resume.
ALTER TABLE switchyard_outbox
    DROP CONSTRAINT switchyard_outbox_status,
    ADD CONSTRAINT switchyard_outbox_status
        CHECK (status IN ('pending', 'in_flight', 'published', 'dead', 'streamed'));

CREATE TABLE switchyard_binlog_positions (
    name          VARCHAR(64)  CHARACTER SET ascii NOT NULL PRIMARY KEY,
    gtid_position TEXT         CHARACTER SET ascii NOT NULL,
    updated_at    DATETIME(6)  NOT NULL
) ENGINE = InnoDB;
