"""The `/v1` API's routers, one per area (FastAPI's "bigger applications"): meta.py (health, stats, metrics),
groups.py (peer lookups, groups by prompt or id, push), rollouts.py (filtered pages of rollouts). Each reads the
store through `dependencies.get_store`; app.py includes them."""
