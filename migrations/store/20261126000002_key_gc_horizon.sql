-- How far retention has deleted finished step keys: no key last written at or after `horizon` was ever
-- deleted. Retention moves it forward (holding its row) before it deletes below it. A consumer that meets a
-- message older than the key retention, whose key it does not find, reads it (sharing the row, so that
-- retention cannot move it meanwhile): a message older than the horizon may have had its key deleted, and
-- is dead-lettered rather than run again.
CREATE TABLE IF NOT EXISTS saga_key_gc_horizon (
    singleton BOOLEAN     PRIMARY KEY DEFAULT true CHECK (singleton),
    horizon   TIMESTAMPTZ NOT NULL
);
