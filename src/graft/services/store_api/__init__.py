"""The trajectory store: `local/` (shards, lookup files, the DuckDB index), `lake/` (the store on a DuckLake), `http/`
(the API and its client), `browser/`; `graft-store` (`cli.py`) and the backend chooser (`backend.py`); shared by them:
`tables.py`, `settings.py`, `targets.py`."""
