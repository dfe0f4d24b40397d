"""Who gets which batch: a stream per shard trainer or broadcast group, and the batches decoded early."""
