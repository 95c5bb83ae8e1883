-- Saga data has a type of the user's, and a saga definition a version (0.3). Each instance records the
-- version of the definition it started with, and keeps running that version after a newer one is deployed
-- (the orchestrator keeps the versions that still have instances). NULL: the instance was stored by 0.2,
-- whose data was untyped JSON (`{"input": ..., "<step>": <reply>}`); it runs on version 1, whose definition
-- reads that form (`SagaDefinition::reads_0_2`) and writes its own on the next transition.
ALTER TABLE saga_instances ADD COLUMN IF NOT EXISTS definition_version INTEGER;
