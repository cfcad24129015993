"""The trajectory store: Parquet shards, the DuckDB index and ingest loop, the FastAPI app and its client."""
