"""The local store: Parquet shards under a root, their lookup files, and the DuckDB index over them (`index.StoreIndex`)."""
