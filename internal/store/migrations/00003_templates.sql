-- +goose Up
-- The template sources each node allows (space serve --template-sources), published by
-- the node at start so the API can refuse a build before it is queued.
CREATE TABLE node_template_sources (
    node_id    text PRIMARY KEY REFERENCES nodes(id) ON DELETE CASCADE,
    sources    jsonb NOT NULL DEFAULT '[]',
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Releases deleted from the database whose artifacts a node still has to remove.
CREATE TABLE template_gc (
    node_id      text NOT NULL REFERENCES nodes(id) ON DELETE CASCADE,
    digest       text NOT NULL,
    requested_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (node_id, digest)
);

CREATE INDEX sandboxes_template_digest ON sandboxes (template_digest) WHERE deleted_at IS NULL;

-- +goose Down
DROP INDEX sandboxes_template_digest;
DROP TABLE template_gc;
DROP TABLE node_template_sources;
