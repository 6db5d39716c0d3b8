"""Request bodies in one place: a content-type check (415: a web page's form post cannot drive a
keyless local server), a size limit (413), JSON parsing where every parser failure is a 400
(malformed or 100,000-deep JSON, a 5,000-digit integer, a lone surrogate such as "\\ud800"), and
strict validation against the request model (400 naming the field)."""
from __future__ import annotations

import asyncio
import json
import re
import reprlib

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from kvflow.server.protocol import ApiError, printable

_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "tuple"}
_OFF_LOOP_BYTES = 64 << 10      # bodies larger than this are parsed in a worker thread
# A \\u escape of a UTF-16 surrogate: the only way a lone surrogate gets into parsed JSON.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_reprs = reprlib.Repr()
_reprs.maxstring = _reprs.maxother = 80
_repr = _reprs.repr


class ClientGone(Exception):
    """The client closed its connection before its request body was complete."""


def _check_content_type(request: Request) -> None:
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, f"the body must be JSON, sent with 'Content-Type: application/json' "
                            f"(got {media or 'no Content-Type'!r})", None,
                       code="unsupported_media_type")


async def _read_body(request: Request, limit: int) -> bytes:
    body, n = [], 0
    try:
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise ApiError(413, f"the request body exceeds the limit of {limit} bytes", None,
                               code="request_too_large")
            body.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(body)


def _lone_surrogate_field(obj: dict) -> str | None:
    """The top-level key under which obj holds a string with a lone surrogate (iteratively:
    the nesting depth is up to the client)."""
    for key, value in obj.items():
        stack = [key, value]
        while stack:
            x = stack.pop()
            if isinstance(x, str):
                if not x.isascii():
                    try:
                        x.encode("utf-8")
                    except UnicodeEncodeError:
                        return key
            elif isinstance(x, dict):
                stack.extend(x.keys())
                stack.extend(x.values())
            elif isinstance(x, list):
                stack.extend(x)
    return None


def _parse_json(raw: bytes) -> dict:
    """Every way json.loads can fail on client bytes is a 400: syntax, encoding (UnicodeError),
    nesting too deep (RecursionError), integers over Python's 4,300-digit limit (ValueError)."""
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deeply", None) from None
    except (ValueError, UnicodeError) as e:         # JSONDecodeError is a ValueError
        raise ApiError(400, f"malformed JSON body: {e}", None) from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(obj).__name__}", None)
    if _SURROGATE_ESCAPE.search(raw):
        field = _lone_surrogate_field(obj)
        if field is not None:
            raise ApiError(400, f"{field}: a string holds a lone UTF-16 surrogate (such as "
                                f"\\ud800), which is not valid Unicode", printable(field))
    return obj


async def read_json(request: Request, limit: int) -> dict:
    _check_content_type(request)
    raw = await _read_body(request, limit)
    if len(raw) > _OFF_LOOP_BYTES:      # a megabyte of JSON takes milliseconds: not on the loop
        return await asyncio.to_thread(_parse_json, raw)
    return _parse_json(raw)


def validate_body(model: type[BaseModel], obj: dict):
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        errs = e.errors()
        first = errs[0]
        param = str(first["loc"][0]) if first["loc"] else None
        # Drop pydantic's union-member tags ('str', 'list[int]', ...) from the location.
        where = ".".join(str(x) for x in first["loc"] if isinstance(x, int) or (
            x not in _TYPE_TAGS and "[" not in x and "-" not in x))
        # reprlib: bounded in length and depth (the input may be 900 levels deep)
        got = _repr(first.get("input")) if first["type"] != "missing" else None
        msg = f"{where}: {first['msg']}" + (f" (got {got})" if got else "")
        raise ApiError(400, msg, param) from None
