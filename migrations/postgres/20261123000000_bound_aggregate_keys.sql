-- aggregate_type and aggregate_id are keys of the aggregate index (a btree
-- row holds at most about 2.7 KB), so an id longer than that made the
-- writer's INSERT fail with an index-row error naming no column. These
-- limits fail it with a constraint that names the column and its bound.
-- NOT VALID: existing rows are not scanned (no long lock); new rows are checked.
ALTER TABLE switchyard_outbox
    ADD CONSTRAINT switchyard_outbox_aggregate_id_at_most_1024_bytes
        CHECK (octet_length(aggregate_id) <= 1024) NOT VALID,
    ADD CONSTRAINT switchyard_outbox_aggregate_type_at_most_255_bytes
        CHECK (octet_length(aggregate_type) <= 255) NOT VALID;
