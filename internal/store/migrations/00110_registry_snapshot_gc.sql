-- +goose Up
-- Snapshot artifacts in the fleet's registry (suspend snapshots, periodic checkpoints,
-- named snapshots) that no row referenced when the controller's garbage collection
-- last looked, and since when (mark and sweep, as registry_release_gc for releases).
CREATE TABLE registry_snapshot_gc (
    digest             text PRIMARY KEY,
    unreferenced_since timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE registry_snapshot_gc;
