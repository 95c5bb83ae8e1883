-- An outage switch for the simulated gateway: while this table has a row, every charge and refund fails
-- as "unavailable" (a transient failure), as a real gateway's would during an outage.
CREATE TABLE IF NOT EXISTS gateway_outage (
    down BOOLEAN PRIMARY KEY CHECK (down)
);
