-- +goose Up
-- Where an operation's time went (docs/lifecycle.md, "Where the time goes"): phases stamped by
-- the processes that reach them (api: claimed; node: node, resumed, booted, identity…),
-- appended in the statements that already write the row. A JSON array of
-- {"phase", "at"}; [] for operations nobody stamped.
ALTER TABLE operations ADD COLUMN timeline jsonb NOT NULL DEFAULT '[]';

-- +goose Down
ALTER TABLE operations DROP COLUMN timeline;
