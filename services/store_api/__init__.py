"""The trajectory store: `local/` (shards, lookup files, the DuckDB index), `lake/` (the store on a DuckLake), `http/`
(the API, its client, `graft-store`), `browser/`; shared by them: `tables.py`, `settings.py`, `targets.py`."""
