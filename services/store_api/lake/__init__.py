"""The store on a DuckLake (a SQL catalog plus Parquet data files): the lake itself, a replica that serves it, migration."""
