-- +goose Up
-- The transition a node is in the middle of (internal/lifecycle.Transition): recorded
-- with every in-between state, so that recovery after a crash knows which transition
-- to resume or roll back ('' when resting).
ALTER TABLE sandboxes ADD COLUMN transition text NOT NULL DEFAULT '';

-- +goose Down
ALTER TABLE sandboxes DROP COLUMN transition;
