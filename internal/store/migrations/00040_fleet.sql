-- +goose Up
-- What each node offers its sandboxes (space serve --capacity, published at
-- registration; 0: not reported, so unbounded), whether an operator cordoned it (no new
-- placements), and why and when it was marked dead.
ALTER TABLE nodes
    ADD COLUMN alloc_cpu       integer NOT NULL DEFAULT 0,
    ADD COLUMN alloc_memory_mb bigint  NOT NULL DEFAULT 0,
    ADD COLUMN alloc_disk_mb   bigint  NOT NULL DEFAULT 0,
    ADD COLUMN cordoned        boolean NOT NULL DEFAULT false,
    ADD COLUMN dead_reason     text    NOT NULL DEFAULT '';

-- +goose Down
ALTER TABLE nodes
    DROP COLUMN alloc_cpu,
    DROP COLUMN alloc_memory_mb,
    DROP COLUMN alloc_disk_mb,
    DROP COLUMN cordoned,
    DROP COLUMN dead_reason;
