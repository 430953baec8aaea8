-- +goose Up
-- Snapshots in the fleet's registry and sandboxes moving between nodes
-- (docs/operations.md, "When a node dies" and "Drain").
--   snapshot_digest: the registry artifact of the sandbox's current suspend snapshot
--     (disk + checkpoint), recorded by its node once pushed; '' when there is none or
--     the sandbox left the suspended state since (its snapshot is stale then).
--   move_from: the node a move takes the sandbox off ('' when not moving); move_started_at
--     when that move began (a drain's suspend, or the wake that re-homed it).
--   moved_at, move_downtime_ms: the last completed move and how long the sandbox was
--     not running for it (or, restored from a periodic checkpoint, how much was lost).
ALTER TABLE sandboxes
    ADD COLUMN snapshot_digest text NOT NULL DEFAULT '',
    ADD COLUMN snapshot_pushed_at timestamptz,
    ADD COLUMN move_from text NOT NULL DEFAULT '',
    ADD COLUMN move_started_at timestamptz,
    ADD COLUMN moved_at timestamptz,
    ADD COLUMN move_downtime_ms bigint NOT NULL DEFAULT 0;

-- +goose Down
ALTER TABLE sandboxes
    DROP COLUMN snapshot_digest,
    DROP COLUMN snapshot_pushed_at,
    DROP COLUMN move_from,
    DROP COLUMN move_started_at,
    DROP COLUMN moved_at,
    DROP COLUMN move_downtime_ms;
