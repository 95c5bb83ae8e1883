-- An isolated message's start is counted when it runs alone, no longer when its batch's start is recorded.
--
-- saga_consumer_begin_batch used to count a start as soon as it decided to isolate a message. The consumer
-- records a batch's start while the batch's transaction already runs (the record is off the critical path),
-- so between the record and the moment the message ran alone, a death caused by another partition's batch
-- was charged to it. Now begin_batch only reports how many isolated attempts never finished (deaths), and the
-- consumer counts the start (`UPDATE ... starts = starts + 1`) once it holds the process alone.
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
        VALUES (p_group, p_topic, p_partition, p_first, 0)
        ON CONFLICT (group_id, topic, partition, "offset") DO UPDATE SET updated_at = now()
        RETURNING s.starts INTO v_deaths;
    END IF;
    INSERT INTO saga_consumer_progress AS p (group_id, topic, partition, batch_offset, batch_end, suspect_until)
    VALUES (p_group, p_topic, p_partition, p_first, v_last, v_suspect)
    ON CONFLICT (group_id, topic, partition) DO UPDATE
        SET batch_offset = p_first, batch_end = v_last, suspect_until = v_suspect, updated_at = now();
    RETURN QUERY SELECT v_suspect IS NOT NULL, v_deaths;
END
$$;
