-- How long each charge took the gateway, in milliseconds, from the call to the statement that writes its
-- ledger row (timed by the calling process alone): the outside call's own time (its latency, its outage
-- check, a wait for one of its connections), which saga-bench takes out of a saga's end-to-end time to show
-- the framework's part. A charge asked again (a retry after a crash) keeps its first call's.
ALTER TABLE gateway_charges ADD COLUMN IF NOT EXISTS call_ms DOUBLE PRECISION;
