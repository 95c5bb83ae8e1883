-- Each failure group's latest letter, read by the index rather than by sorting the group.
CREATE INDEX IF NOT EXISTS saga_dead_letters_group_time
    ON saga_dead_letters (dlq_topic, failure_group, failed_at, dlq_partition, dlq_offset);
DROP INDEX IF EXISTS saga_dead_letters_group;
