-- How far retention has deleted finished step keys: no key last written at or after `horizon` was ever
-- deleted. Retention moves it forward, and commits that, before it deletes below it. A consumer that just
-- claimed a message's key as new reads it: a message older than the horizon may have had its key deleted
-- after its step ran, and is dead-lettered rather than run again.
CREATE TABLE IF NOT EXISTS saga_key_gc_horizon (
    singleton BOOLEAN     PRIMARY KEY DEFAULT true CHECK (singleton),
    horizon   TIMESTAMPTZ NOT NULL
);
