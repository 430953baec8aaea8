-- +goose Up
CREATE TABLE api_keys (
    id           text PRIMARY KEY,
    name         text NOT NULL,
    prefix       text NOT NULL,
    hash         bytea NOT NULL UNIQUE,
    kind         text NOT NULL DEFAULT 'space',
    tenant       text NOT NULL DEFAULT 'default',
    admin        boolean NOT NULL DEFAULT false,
    created_at   timestamptz NOT NULL DEFAULT now(),
    revoked_at   timestamptz,
    last_used_at timestamptz
);

CREATE TABLE signing_keys (
    id         text PRIMARY KEY,
    secret     bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE nodes (
    id             text PRIMARY KEY,
    name           text NOT NULL UNIQUE,
    runtime        text NOT NULL,
    runtime_info   jsonb NOT NULL DEFAULT '{}',
    data_plane_url text NOT NULL,
    epoch          bigint NOT NULL DEFAULT 1,
    state          text NOT NULL DEFAULT 'alive',
    started_at     timestamptz NOT NULL DEFAULT now(),
    heartbeat_at   timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE template_releases (
    digest     text PRIMARY KEY,
    name       text NOT NULL,
    config     jsonb NOT NULL DEFAULT '{}',
    size_bytes bigint NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE template_tags (
    name       text NOT NULL,
    tag        text NOT NULL,
    digest     text NOT NULL REFERENCES template_releases(digest),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (name, tag)
);

-- Which node holds the artifacts of which release.
CREATE TABLE node_releases (
    node_id text NOT NULL REFERENCES nodes(id) ON DELETE CASCADE,
    digest  text NOT NULL REFERENCES template_releases(digest) ON DELETE CASCADE,
    PRIMARY KEY (node_id, digest)
);

CREATE TABLE sandboxes (
    id                  text PRIMARY KEY,
    tenant              text NOT NULL DEFAULT 'default',
    template_ref        text NOT NULL,
    template_digest     text,
    spec                jsonb NOT NULL,
    metadata            jsonb NOT NULL DEFAULT '{}',
    desired_state       text NOT NULL,
    state               text NOT NULL,
    generation          bigint NOT NULL DEFAULT 1,
    observed_generation bigint NOT NULL DEFAULT 0,
    node_id             text REFERENCES nodes(id),
    runtime             text NOT NULL DEFAULT '',
    start_path          text NOT NULL DEFAULT '',
    error               text NOT NULL DEFAULT '',
    token_epoch         bigint NOT NULL DEFAULT 1,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    expires_at          timestamptz,
    deleted_at          timestamptz
);
CREATE INDEX sandboxes_node ON sandboxes (node_id) WHERE deleted_at IS NULL;
CREATE INDEX sandboxes_pending ON sandboxes (created_at) WHERE node_id IS NULL AND deleted_at IS NULL;
CREATE INDEX sandboxes_metadata ON sandboxes USING gin (metadata);
CREATE INDEX sandboxes_expires ON sandboxes (expires_at) WHERE expires_at IS NOT NULL AND deleted_at IS NULL;

CREATE TABLE operations (
    id                text PRIMARY KEY,
    kind              text NOT NULL,
    sandbox_id        text REFERENCES sandboxes(id) ON DELETE CASCADE,
    tenant            text NOT NULL DEFAULT 'default',
    target_generation bigint NOT NULL DEFAULT 0,
    state             text NOT NULL,
    message           text NOT NULL DEFAULT '',
    error             text NOT NULL DEFAULT '',
    params            jsonb NOT NULL DEFAULT '{}',
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    done_at           timestamptz
);
CREATE INDEX operations_sandbox ON operations (sandbox_id, created_at);
CREATE INDEX operations_open ON operations (kind) WHERE done_at IS NULL;

CREATE TABLE operation_log (
    op_id text NOT NULL REFERENCES operations(id) ON DELETE CASCADE,
    seq   bigserial,
    at    timestamptz NOT NULL DEFAULT now(),
    line  text NOT NULL,
    PRIMARY KEY (op_id, seq)
);

CREATE TABLE idempotency_keys (
    tenant     text NOT NULL,
    key        text NOT NULL,
    method     text NOT NULL,
    path       text NOT NULL,
    body_hash  bytea NOT NULL,
    status     int NOT NULL,
    response   bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, key)
);

-- +goose Down
DROP TABLE idempotency_keys;
DROP TABLE operation_log;
DROP TABLE operations;
DROP TABLE sandboxes;
DROP TABLE node_releases;
DROP TABLE template_tags;
DROP TABLE template_releases;
DROP TABLE nodes;
DROP TABLE signing_keys;
DROP TABLE api_keys;
