"""The store's HTTP face: the FastAPI app, push bodies, the client trainers use, the test server and `graft-store`."""
