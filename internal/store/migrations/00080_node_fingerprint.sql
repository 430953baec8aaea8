-- +goose Up
-- Which installation registered a node's id (docs/operations.md, "Copied node ids"):
-- the host's machine id (hashed), the absolute data directory and the btrfs store's
-- file system id. A restart of the same installation presents the same fingerprint;
-- a data directory copied to another host or path does not, and is refused.
-- '' on rows registered before this column existed: the next registration sets it.
ALTER TABLE nodes ADD COLUMN fingerprint text NOT NULL DEFAULT '';

-- +goose Down
ALTER TABLE nodes DROP COLUMN fingerprint;
