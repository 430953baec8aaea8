-- +goose Up
-- Periodic checkpoints (a sandbox's checkpoint_interval): the registry artifact of its
-- last checkpoint and when it was taken; a sandbox whose node dies is restored
-- elsewhere from it, and checkpoint_loss_ms records how much it lost (the time from that
-- checkpoint to its node's death).
ALTER TABLE sandboxes
    ADD COLUMN checkpoint_digest text NOT NULL DEFAULT '',
    ADD COLUMN checkpoint_at timestamptz,
    ADD COLUMN checkpoint_loss_ms bigint NOT NULL DEFAULT 0;

-- +goose Down
ALTER TABLE sandboxes
    DROP COLUMN checkpoint_digest,
    DROP COLUMN checkpoint_at,
    DROP COLUMN checkpoint_loss_ms;
