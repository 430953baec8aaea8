-- +goose Up
-- Tenants are a resource of their own (docs/security.md, "Tenancy"). A quota column
-- that is NULL takes the server's default (space serve --quota-* flags); -1 means
-- unlimited.
CREATE TABLE tenants (
    name              text PRIMARY KEY,
    created_at        timestamptz NOT NULL DEFAULT now(),
    running_sandboxes bigint,
    vcpus             bigint,
    memory_mb         bigint,
    disk_mb           bigint,
    operations        bigint,
    request_rate      bigint,
    request_burst     bigint
);

-- Existing data: the tenants it names (everything the CLI made is in "default").
INSERT INTO tenants (name) VALUES ('default');
INSERT INTO tenants (name)
    SELECT tenant FROM api_keys
    UNION SELECT tenant FROM sandboxes WHERE tenant <> ''
    UNION SELECT tenant FROM operations WHERE tenant <> ''
    UNION SELECT tenant FROM idempotency_keys
ON CONFLICT DO NOTHING;

-- Roles replace the admin flag: operator (sees every tenant, manages tenants, quotas,
-- nodes and shared templates), admin (manages its tenant's keys, templates and pools)
-- and member. Admin keys of earlier versions saw every tenant: they become operators.
ALTER TABLE api_keys ADD COLUMN role text NOT NULL DEFAULT 'member';
UPDATE api_keys SET role = 'operator' WHERE admin;
ALTER TABLE api_keys DROP COLUMN admin;
ALTER TABLE api_keys ALTER COLUMN tenant DROP DEFAULT;
ALTER TABLE api_keys ADD CONSTRAINT api_keys_tenant_fkey FOREIGN KEY (tenant) REFERENCES tenants (name) ON DELETE CASCADE;
CREATE INDEX api_keys_tenant ON api_keys (tenant);

-- The E2B envd access token is bound to this epoch: revoke-tokens and explicit
-- pause/resume bump it (automatic suspends do not, so autoResume keeps working).
ALTER TABLE sandboxes ADD COLUMN access_epoch bigint NOT NULL DEFAULT 1;
CREATE INDEX sandboxes_tenant ON sandboxes (tenant) WHERE deleted_at IS NULL;
CREATE INDEX operations_tenant_open ON operations (tenant) WHERE done_at IS NULL;

-- Templates: '' is shared (builtin templates and operators' builds, read-only for
-- tenants); a tenant's own tags and releases are its own. Existing templates were
-- visible to every key and stay shared.
ALTER TABLE template_releases ADD COLUMN tenant text NOT NULL DEFAULT '';
ALTER TABLE template_tags ADD COLUMN tenant text NOT NULL DEFAULT '';
ALTER TABLE template_tags DROP CONSTRAINT template_tags_pkey;
ALTER TABLE template_tags ADD PRIMARY KEY (tenant, name, tag);

-- Warm pools belong to a tenant; existing pools to "default". Their members' pool keys
-- now start with the tenant, so members of the old keys are drained and refilled.
ALTER TABLE pools ADD COLUMN tenant text NOT NULL DEFAULT 'default';
ALTER TABLE pools DROP CONSTRAINT pools_pkey;
ALTER TABLE pools ADD PRIMARY KEY (tenant, template, cpu, memory_mb);
ALTER TABLE pools ALTER COLUMN tenant DROP DEFAULT;

-- +goose Down
ALTER TABLE pools DROP CONSTRAINT pools_pkey;
DELETE FROM pools WHERE tenant <> 'default';
ALTER TABLE pools DROP COLUMN tenant;
ALTER TABLE pools ADD PRIMARY KEY (template, cpu, memory_mb);
ALTER TABLE template_tags DROP CONSTRAINT template_tags_pkey;
DELETE FROM template_tags WHERE tenant <> '';
ALTER TABLE template_tags DROP COLUMN tenant;
ALTER TABLE template_tags ADD PRIMARY KEY (name, tag);
ALTER TABLE template_releases DROP COLUMN tenant;
DROP INDEX operations_tenant_open;
DROP INDEX sandboxes_tenant;
ALTER TABLE sandboxes DROP COLUMN access_epoch;
DROP INDEX api_keys_tenant;
ALTER TABLE api_keys DROP CONSTRAINT api_keys_tenant_fkey;
ALTER TABLE api_keys ALTER COLUMN tenant SET DEFAULT 'default';
ALTER TABLE api_keys ADD COLUMN admin boolean NOT NULL DEFAULT false;
UPDATE api_keys SET admin = true WHERE role = 'operator';
ALTER TABLE api_keys DROP COLUMN role;
DROP TABLE tenants;
