-- +goose Up
-- A node's disk status, published with its heartbeat: why it refuses new disk use
-- (its free space is at the operator's reserve), or '' when it has room.
ALTER TABLE nodes ADD COLUMN disk_low text NOT NULL DEFAULT '';

-- +goose Down
ALTER TABLE nodes DROP COLUMN disk_low;
