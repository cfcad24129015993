"""The read-only trajectory browser: its routes, the views' queries, token text, and the static page (ui/)."""
