-- +goose Up
-- The registry artifact of a named snapshot (its memory and disk), recorded by the node
-- that took it once pushed: a sandbox can then be created from the snapshot on another
-- node when the snapshot's own node is dead ('' until pushed, or without a registry).
ALTER TABLE snapshots ADD COLUMN registry_digest text NOT NULL DEFAULT '';

-- +goose Down
ALTER TABLE snapshots DROP COLUMN registry_digest;
