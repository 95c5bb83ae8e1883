-- Poison-pill detection across crashes. Applied by saga-consumer (`saga_consumer::migrate`).
--
-- Written to be re-runnable: databases set up by 0.1.0, whose single migration set already created these
-- objects, upgrade by running it again (IF NOT EXISTS, OR REPLACE).
--
-- Before a consumer processes a batch of a partition it records the batch's offset range here, in its own
-- (asynchronously committed) transaction. The next batch of that partition normally starts after the range.
-- If it starts inside it instead, the last run died (or was stopped) during the batch: everything up to the
-- end of that range is then processed one message at a time ("isolation"), and each isolated message is
-- counted in saga_consumer_suspects until it finishes. A message found there too often is the one that kills
-- the process; the runtime dead-letters it instead of dying again.
CREATE TABLE IF NOT EXISTS saga_consumer_progress (
    group_id      TEXT        NOT NULL,
    topic         TEXT        NOT NULL,
    partition     INTEGER     NOT NULL,
    batch_offset  BIGINT      NOT NULL,
    batch_end     BIGINT      NOT NULL,
    -- While set, batches up to this offset are processed one message at a time.
    suspect_until BIGINT,
    updated_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (group_id, topic, partition)
);

CREATE TABLE IF NOT EXISTS saga_consumer_suspects (
    group_id   TEXT        NOT NULL,
    topic      TEXT        NOT NULL,
    partition  INTEGER     NOT NULL,
    "offset"   BIGINT      NOT NULL,
    -- How many times processing this message started in isolation.
    starts     INTEGER     NOT NULL,
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (group_id, topic, partition, "offset")
);

-- Records that a batch [p_first, p_last] begins. Returns whether to process p_first alone, and how many
-- earlier isolated attempts at p_first never finished (deaths).
CREATE OR REPLACE FUNCTION saga_consumer_begin_batch(
    p_group TEXT, p_topic TEXT, p_partition INTEGER, p_first BIGINT, p_last BIGINT
) RETURNS TABLE (isolate BOOLEAN, deaths INTEGER) LANGUAGE plpgsql AS $$
DECLARE
    prev saga_consumer_progress;
    v_suspect BIGINT;
    v_deaths INTEGER := 0;
    v_last BIGINT := p_last;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT * INTO prev FROM saga_consumer_progress
    WHERE group_id = p_group AND topic = p_topic AND partition = p_partition FOR UPDATE;
    IF FOUND THEN
        v_suspect := prev.suspect_until;
        IF prev.batch_offset <= p_last AND p_first <= prev.batch_end THEN
            v_suspect := greatest(coalesce(v_suspect, prev.batch_end), prev.batch_end);
        END IF;
        IF v_suspect < p_first THEN
            v_suspect := NULL;
        END IF;
    END IF;
    IF v_suspect IS NOT NULL THEN
        v_last := p_first;
        INSERT INTO saga_consumer_suspects AS s (group_id, topic, partition, "offset", starts)
        VALUES (p_group, p_topic, p_partition, p_first, 1)
        ON CONFLICT (group_id, topic, partition, "offset") DO UPDATE
            SET starts = s.starts + 1, updated_at = now()
        RETURNING s.starts - 1 INTO v_deaths;
    END IF;
    INSERT INTO saga_consumer_progress AS p (group_id, topic, partition, batch_offset, batch_end, suspect_until)
    VALUES (p_group, p_topic, p_partition, p_first, v_last, v_suspect)
    ON CONFLICT (group_id, topic, partition) DO UPDATE
        SET batch_offset = p_first, batch_end = v_last, suspect_until = v_suspect, updated_at = now();
    RETURN QUERY SELECT v_suspect IS NOT NULL, v_deaths;
END
$$;

-- Records that the batch starting at p_first ended: finished (p_finished) or abandoned on purpose (a revoke
-- or a shutdown, which must not count as a death). Either way an isolated message is no longer a suspect.
CREATE OR REPLACE FUNCTION saga_consumer_end_batch(
    p_group TEXT, p_topic TEXT, p_partition INTEGER, p_first BIGINT, p_finished BOOLEAN
) RETURNS VOID LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    DELETE FROM saga_consumer_suspects
    WHERE group_id = p_group AND topic = p_topic AND partition = p_partition AND "offset" = p_first;
    IF NOT p_finished THEN
        UPDATE saga_consumer_progress SET batch_end = batch_offset - 1, updated_at = now()
        WHERE group_id = p_group AND topic = p_topic AND partition = p_partition AND batch_offset = p_first;
    END IF;
END
$$;
