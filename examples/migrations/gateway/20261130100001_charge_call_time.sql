-- How long each charge took the gateway, from the call to its ledger row, in milliseconds: the outside
-- call's own time (the gateway's latency and its storage), which saga-bench takes out of a saga's end-to-end
-- time to show the framework's part. A charge asked again (a retry after a crash) keeps its first call's.
ALTER TABLE gateway_charges ADD COLUMN IF NOT EXISTS call_ms DOUBLE PRECISION;
