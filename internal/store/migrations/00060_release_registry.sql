-- +goose Up
-- Template releases in the fleet's registry (space serve --registry; docs/operations.md,
-- "Registry"): the manifest digest of the release's artifact once a node pushed it
-- ('' = only on the nodes that hold it), and when. Only a release in the registry can
-- be started by a node that does not hold it.
ALTER TABLE template_releases
    ADD COLUMN registry_digest text NOT NULL DEFAULT '',
    ADD COLUMN pushed_at       timestamptz;

-- Release artifacts in the registry that nothing in the database referenced when the
-- controller's garbage collection last looked, and since when (mark and sweep: an
-- artifact is deleted only after it stayed unreferenced for the grace period).
CREATE TABLE registry_release_gc (
    digest             text PRIMARY KEY,
    unreferenced_since timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE registry_release_gc;
ALTER TABLE template_releases
    DROP COLUMN registry_digest,
    DROP COLUMN pushed_at;
