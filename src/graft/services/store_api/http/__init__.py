"""The store's HTTP face: the FastAPI app (app.py) and its routers (routes/), push bodies, the client trainers use and
the test server. VERSION is the installed graft's version, which the app and /v1/health report."""

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("graft")
except PackageNotFoundError:  # running from a checkout without `pip install -e .`
    VERSION = "0.0.0"
