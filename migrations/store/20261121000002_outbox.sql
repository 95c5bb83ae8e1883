-- The transactional outbox. Rows are written in the producing transaction and published by outbox-relay.
--
-- Ordering: writers call saga_outbox_append(), which takes a transaction-scoped advisory lock per partition
-- key before the rows get their ids. A second transaction writing the same key therefore waits until the
-- first has committed before its rows are numbered, so for one key id order is commit order. The relay
-- marks every row it publishes (no "published up to id N" watermark), so a row that becomes visible late is
-- still found: nothing is skipped.
CREATE TABLE saga_outbox (
    id            BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id     TEXT        NOT NULL,
    topic         TEXT        NOT NULL,
    -- The Kafka message key (the aggregate id); NULL publishes without a key.
    partition_key TEXT,
    -- Kafka headers in order, flattened: name, value, name, value, ...
    headers       TEXT[]      NOT NULL DEFAULT '{}',
    payload       BYTEA,
    -- Relay instances own shards of the key space; one key always maps to one shard.
    shard         SMALLINT    NOT NULL GENERATED ALWAYS AS ((hashtext(coalesce(partition_key, '')) & 63)::smallint) STORED,
    created_at    TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    -- When the broker acknowledged the row (NULL: not yet published).
    published_at  TIMESTAMPTZ,
    -- Failed publication attempts, for rows the broker refused.
    attempts      INTEGER     NOT NULL DEFAULT 0,
    last_error    TEXT
);

CREATE INDEX saga_outbox_unpublished ON saga_outbox (id) WHERE published_at IS NULL;
CREATE INDEX saga_outbox_published ON saga_outbox (published_at) WHERE published_at IS NOT NULL;

-- One notification per inserting statement, delivered at commit; the payload is the schema, so relays of
-- several services sharing a database wake only for their own outbox.
CREATE FUNCTION saga_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('saga_outbox', TG_TABLE_SCHEMA);
    RETURN NULL;
END
$$;

CREATE TRIGGER saga_outbox_notify AFTER INSERT ON saga_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION saga_outbox_notify();

-- Appends rows in argument order, after locking their partition keys (in a fixed order, so that two
-- appenders cannot deadlock each other). Returns the new ids.
-- p_headers is one flattened header array per row, as text (a two-dimensional array cannot have rows of
-- different lengths).
CREATE FUNCTION saga_outbox_append(
    p_tenant  TEXT[],
    p_topic   TEXT[],
    p_key     TEXT[],
    p_headers TEXT[],
    p_payload BYTEA[]
) RETURNS SETOF BIGINT LANGUAGE plpgsql AS $$
BEGIN
    -- The sorted subquery is scanned in order, so the locks are taken in hash order. The schema is part of
    -- the hash: outboxes of services sharing a database do not contend.
    PERFORM pg_advisory_xact_lock(1397178177, key_hash)
    FROM (
        SELECT DISTINCT hashtext(current_schema() || '/' || k) AS key_hash
        FROM unnest(p_key) AS k WHERE k IS NOT NULL ORDER BY 1
    ) AS keys;
    RETURN QUERY
        INSERT INTO saga_outbox (tenant_id, topic, partition_key, headers, payload)
        SELECT r.tenant, r.topic, r.key, r.headers::TEXT[], r.payload
        FROM unnest(p_tenant, p_topic, p_key, p_headers, p_payload)
             WITH ORDINALITY AS r(tenant, topic, key, headers, payload, ord)
        ORDER BY r.ord
        RETURNING id;
END
$$;
