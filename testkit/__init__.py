"""What the tests and the benchmarks use to break things for real, and the fixtures they read: not
part of the product, and not in the wheel. ``netfaults``: a TCP proxy that adds latency, stalls
and resets; ``s3server``: a real S3 server (SeaweedFS) on loopback; ``counting``: readers that count
what a service reads; ``fixtures``: tar shards and Parquet files made from an ImageFolder."""
