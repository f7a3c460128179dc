-- Which relay serves this database when several relays share many
-- databases out (`[ownership]`): one row, held under a lease its owner
-- renews. A relay takes it when it is free or its lease has run out; the
-- token grows with every new owner, so a renewal by a former owner fails.
CREATE TABLE IF NOT EXISTS switchyard_ownership (
    id         smallint PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    owner      text,
    token      bigint NOT NULL DEFAULT 0,
    expires_at timestamptz NOT NULL DEFAULT '-infinity'
);
INSERT INTO switchyard_ownership (id) VALUES (1) ON CONFLICT DO NOTHING;
