"""The read-only trajectory browser: its routes, the aggregate queries behind them, token text, and the static page (ui/)."""
