-- Which relay serves this database (see the PostgreSQL migration of the
-- same name). Times in milliseconds since the epoch, as elsewhere.
CREATE TABLE IF NOT EXISTS switchyard_ownership (
    id         INTEGER PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    owner      TEXT,
    token      INTEGER NOT NULL DEFAULT 0,
    expires_at INTEGER NOT NULL DEFAULT 0
);
INSERT INTO switchyard_ownership (id) VALUES (1) ON CONFLICT DO NOTHING;
