-- The same bounds as on PostgreSQL (where they keep aggregate index rows
-- within a btree page), so a service moving between the two sees one limit.
CREATE TRIGGER switchyard_outbox_aggregate_keys_bounded
BEFORE INSERT ON switchyard_outbox
WHEN length(CAST(NEW.aggregate_id AS BLOB)) > 1024 OR length(CAST(NEW.aggregate_type AS BLOB)) > 255
BEGIN
    SELECT RAISE(ABORT, 'switchyard_outbox.aggregate_id must be at most 1024 bytes and aggregate_type at most 255 bytes');
END;
