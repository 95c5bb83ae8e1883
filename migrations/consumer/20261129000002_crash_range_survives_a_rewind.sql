-- A range the last run died in stays suspect when the restart redelivers batches before it.
--
-- saga_consumer_begin_batch compared a batch only with the last recorded range: a batch wholly before it
-- replaced the record. The committed offset lags the database by up to SAGA_COMMIT_INTERVAL_MS, so a
-- restart's first batches often lie before the range the process died in; the first of them replaced the
-- record, the range was never isolated, and a message that kills the process at once could do so forever.
-- Now a batch that meets an open range it did not follow, by overlapping it or by lying wholly before it,
-- makes that range the suspect range, bounded below by suspect_from; only a batch that reaches into it goes
-- one message at a time, so the duplicates redelivered before it run normally. A range ended unfinished on
-- purpose (batch_end below batch_offset) is closed and blames nothing.
--
-- The function also says whether the partition is clear (no suspect range left): only then may the worker
-- record its next batch beside the batch's transaction, whose handlers run before the record is read. A
-- batch of a suspect range recorded that way ran its first message before learning it was to go alone,
-- uncounted, so a message that kills the process in its handler was never dead-lettered.
--
-- The decisions are saga-consumer's `crash_record` (its model drives them; a test holds this function to
-- them). A row written before this migration has no suspect_from: its suspect range reaches down to the
-- partition's start, as it did. The function's arguments are unchanged and its first two results too, so a
-- consumer of the earlier version keeps working beside this one.
ALTER TABLE saga_consumer_progress ADD COLUMN IF NOT EXISTS suspect_from BIGINT;

DROP FUNCTION IF EXISTS saga_consumer_begin_batch(TEXT, TEXT, INTEGER, BIGINT, BIGINT);
CREATE FUNCTION saga_consumer_begin_batch(
    p_group TEXT, p_topic TEXT, p_partition INTEGER, p_first BIGINT, p_last BIGINT
) RETURNS TABLE (isolate BOOLEAN, deaths INTEGER, clear BOOLEAN) LANGUAGE plpgsql AS $$
DECLARE
    prev saga_consumer_progress;
    v_from BIGINT;
    v_until BIGINT;
    v_isolate BOOLEAN := false;
    v_deaths INTEGER := 0;
    v_last BIGINT := p_last;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT * INTO prev FROM saga_consumer_progress
    WHERE group_id = p_group AND topic = p_topic AND partition = p_partition FOR UPDATE;
    IF FOUND THEN
        v_from := prev.suspect_from;
        v_until := prev.suspect_until;
        -- An open range met by a batch that did not follow it: the run that recorded it died there.
        IF prev.batch_offset <= prev.batch_end
           AND (p_last < prev.batch_offset OR (prev.batch_offset <= p_last AND p_first <= prev.batch_end)) THEN
            IF v_until IS NULL THEN
                v_from := prev.batch_offset;
            ELSIF v_from IS NOT NULL THEN
                v_from := least(v_from, prev.batch_offset);
            END IF;
            v_until := greatest(coalesce(v_until, prev.batch_end), prev.batch_end);
        END IF;
        IF v_until < p_first THEN
            v_from := NULL;
            v_until := NULL;
        END IF;
        v_isolate := v_until IS NOT NULL AND (v_from IS NULL OR v_from <= p_last);
    END IF;
    IF v_isolate THEN
        v_last := p_first;
        INSERT INTO saga_consumer_suspects AS s (group_id, topic, partition, "offset", starts)
        VALUES (p_group, p_topic, p_partition, p_first, 0)
        ON CONFLICT (group_id, topic, partition, "offset") DO UPDATE SET updated_at = now()
        RETURNING s.starts INTO v_deaths;
    END IF;
    INSERT INTO saga_consumer_progress AS p
        (group_id, topic, partition, batch_offset, batch_end, suspect_from, suspect_until)
    VALUES (p_group, p_topic, p_partition, p_first, v_last, v_from, v_until)
    ON CONFLICT (group_id, topic, partition) DO UPDATE
        SET batch_offset = p_first, batch_end = v_last, suspect_from = v_from, suspect_until = v_until,
            updated_at = now();
    RETURN QUERY SELECT v_isolate, v_deaths, v_until IS NULL;
END
$$;

-- Closes the range first..=last of a worker that stops between batches, its batch finished, if the row is
-- still that worker's clear record: nothing died in it, so a new owner starting behind it (a commit refused
-- on revoke, offsets reset back) must not take it for a range a run died in. A row another worker wrote
-- since (a suspect's isolated record, another range) is left alone, and no death count is touched.
CREATE OR REPLACE FUNCTION saga_consumer_close_batch(
    p_group TEXT, p_topic TEXT, p_partition INTEGER, p_first BIGINT, p_last BIGINT
) RETURNS VOID LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    UPDATE saga_consumer_progress SET batch_end = batch_offset - 1, updated_at = now()
    WHERE group_id = p_group AND topic = p_topic AND partition = p_partition
      AND batch_offset = p_first AND batch_end = p_last AND suspect_until IS NULL;
END
$$;
