-- +goose Up
-- Named snapshots (docs/lifecycle.md, "Named snapshots"): a sandbox's memory and disk
-- captured once and kept on the node that took it, independent of the sandbox.
-- A row is made (creating) before any file, becomes ready in the same transaction
-- that completes its operation, and is removed after its files are; a failed capture
-- removes the row (its operation keeps the error).
CREATE TABLE snapshots (
    id              text PRIMARY KEY,
    tenant          text NOT NULL DEFAULT 'default',
    name            text NOT NULL,
    state           text NOT NULL,
    source_sandbox  text NOT NULL,
    template_ref    text NOT NULL,
    template_digest text NOT NULL DEFAULT '',
    spec            jsonb NOT NULL,
    runtime         text NOT NULL DEFAULT '',
    node_id         text NOT NULL,
    size_bytes      bigint NOT NULL DEFAULT 0,
    op_id           text NOT NULL DEFAULT '',
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    ready_at        timestamptz
);
-- Names are unique per tenant among snapshots not being deleted.
CREATE UNIQUE INDEX snapshots_name ON snapshots (tenant, name) WHERE state <> 'deleting';
CREATE INDEX snapshots_source ON snapshots (source_sandbox) WHERE state = 'creating';
CREATE INDEX snapshots_node ON snapshots (node_id);
CREATE INDEX sandboxes_snapshot ON sandboxes ((spec->>'snapshot')) WHERE spec ? 'snapshot' AND deleted_at IS NULL;

-- Resource samples of sandboxes (docs/operations.md, "Sandbox metrics"): raw samples
-- every few seconds, averaged into minutes and hours as they age, bounded per sandbox.
CREATE TABLE sandbox_metrics (
    sandbox_id text NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
    -- resolution is the seconds a row stands for: the sample period, 60 or 3600.
    resolution int NOT NULL,
    at         timestamptz NOT NULL,
    cpu_pct    real NOT NULL,
    mem_used   bigint NOT NULL,
    mem_cache  bigint NOT NULL,
    disk_used  bigint NOT NULL,
    PRIMARY KEY (sandbox_id, resolution, at)
);

-- +goose Down
DROP TABLE sandbox_metrics;
DROP INDEX sandboxes_snapshot;
DROP TABLE snapshots;
