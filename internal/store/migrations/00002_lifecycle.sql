-- +goose Up
ALTER TABLE sandboxes
    ADD COLUMN idle_timeout_seconds bigint NOT NULL DEFAULT 21600,
    ADD COLUMN last_activity_at     timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN status_reason        text NOT NULL DEFAULT '',
    ADD COLUMN status_changed_at    timestamptz,
    ADD COLUMN clone_of             text,
    ADD COLUMN clone_batch          text,
    ADD COLUMN clone_ready          boolean NOT NULL DEFAULT false,
    ADD COLUMN pool_key             text,
    ADD COLUMN claimed_at           timestamptz,
    ADD COLUMN disk_exclusive_bytes bigint NOT NULL DEFAULT 0,
    ADD COLUMN identity_generation  bigint NOT NULL DEFAULT 0,
    -- What happens when expires_at passes: delete (space's TTL, E2B's default) or
    -- suspend (E2B's autoPause).
    ADD COLUMN expire_action        text NOT NULL DEFAULT 'delete';

CREATE INDEX sandboxes_idle ON sandboxes (last_activity_at) WHERE state = 'running' AND deleted_at IS NULL;
CREATE INDEX sandboxes_pool ON sandboxes (pool_key, state) WHERE pool_key IS NOT NULL AND deleted_at IS NULL;
CREATE INDEX sandboxes_clone_of ON sandboxes (clone_of) WHERE clone_of IS NOT NULL AND deleted_at IS NULL;

-- Warm pools: keep Size parked sandboxes of a template and size class.
CREATE TABLE pools (
    template   text NOT NULL,
    cpu        int NOT NULL,
    memory_mb  int NOT NULL,
    size       int NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (template, cpu, memory_mb)
);

-- +goose Down
DROP TABLE pools;
DROP INDEX sandboxes_clone_of;
DROP INDEX sandboxes_pool;
DROP INDEX sandboxes_idle;
ALTER TABLE sandboxes
    DROP COLUMN idle_timeout_seconds, DROP COLUMN last_activity_at, DROP COLUMN status_reason,
    DROP COLUMN status_changed_at, DROP COLUMN clone_of, DROP COLUMN clone_batch, DROP COLUMN clone_ready,
    DROP COLUMN pool_key, DROP COLUMN claimed_at, DROP COLUMN disk_exclusive_bytes, DROP COLUMN identity_generation,
    DROP COLUMN expire_action;
