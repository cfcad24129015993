"""The store app's two ASGI wrappers, which run before FastAPI: `BodySizeLimit` (413 for bodies over a limit, reading
nothing ahead) and `LookupFastPath` (valid Arrow peer lookups answered without FastAPI's routing). `app.py` wraps
its app in them."""

from __future__ import annotations

import orjson
from fastapi import HTTPException
from pydantic import ValidationError

from graft.schemas import ARROW_MEDIA_TYPE, LOOKUP_PATH, PUSH_PATH, PeerLookupRequest

# ------------------------------------------------------------------------------------------ body size limit


class BodyTooLarge(HTTPException):
    """Raised by BodySizeLimit's `receive` once a body without Content-Length goes past the limit; an
    HTTPException, so that FastAPI's body parsing passes it on as it is (other errors there become a 400)."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body exceeds the limit of {limit} bytes")


class BodySizeLimit:
    """Refuse request bodies over a limit with 413 (POST /v1/groups has its own limit), reading nothing ahead.

    A declared Content-Length over the limit is refused before the app runs. A chunked body is counted as the
    app reads it and refused the moment it passes the limit: nothing is read before the route asks for it, so a
    write without its bearer token gets its 401 without its body being read.
    """

    def __init__(self, app, push_limit: int, other_limit: int):
        self.app = app
        self.push_limit = push_limit
        self.other_limit = other_limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.push_limit if scope["path"] == PUSH_PATH else self.other_limit
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > limit
            except ValueError:
                return await self._refuse(send, 400, f"Content-Length {length!r} is not a number")
            if too_big:
                return await self._refuse(send, 413, f"request body of {int(length)} bytes exceeds the limit of {limit} "
                                                     "bytes: send fewer groups or prompt ids per request")
            return await self.app(scope, receive, send)
        received = 0
        started = False

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except BodyTooLarge as exc:  # raised where no route turned it into a response (LookupFastPath)
            if started:
                raise
            await self._refuse(send, 413, exc.detail)

    @staticmethod
    async def _refuse(send, status: int, message: str) -> None:
        body = orjson.dumps({"error": message})
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def replaying(body: bytes, receive):
    """An ASGI `receive` that hands out an already read request body, then defers to `receive`."""
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


# ------------------------------------------------------------------------------------------ lookup fast path

class LookupFastPath:
    """Answer valid Arrow peer lookups before FastAPI's routing, dependency and response machinery.

    That machinery cost ~0.18 ms of the ~0.25 ms of app CPU per single-prompt lookup on the 2-core VM, for
    a call whose budget is 2 ms end to end. Anything else, including every request that does not validate,
    goes on to the FastAPI route, which documents the endpoint and words the errors.
    """

    def __init__(self, app, answer):
        self.app = app
        self.answer = answer  # async (PeerLookupRequest) -> bytes of the Arrow IPC stream

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != LOOKUP_PATH or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        # the same requests FastAPI reads as a JSON body; other content types get its error
        json_body = headers.get(b"content-type", b"").split(b";")[0].strip().lower() == b"application/json"
        if not json_body or ARROW_MEDIA_TYPE.encode() not in headers.get(b"accept", b""):
            return await self.app(scope, receive, send)
        chunks = []
        while True:  # the body is within the size limit: BodySizeLimit runs first
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left: nobody to answer
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            req = PeerLookupRequest.model_validate_json(body)
        except ValidationError:
            return await self.app(scope, replaying(body, receive), send)
        stream = await self.answer(req)
        headers = [(b"content-type", ARROW_MEDIA_TYPE.encode()), (b"content-length", b"%d" % len(stream))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": stream})
