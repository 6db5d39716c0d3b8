"""The API's ways to ask for structured outputs, as one StructuredOutputsParams: OpenAI's
`response_format` and vLLM's `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` extras and its `structured_outputs` object. At most one may be given; a
malformed value, or a grammar xgrammar cannot compile, is a 400 naming the field.

Torch-free like the rest of the server's process: grammars are compiled by the engine core,
which the server asks (check_structured_outputs) before it answers 200, so that a stream
never starts for a request whose schema is bad.
"""
from __future__ import annotations

from kvflow.engine.async_llm import EngineDeadError
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams
from kvflow.server.protocol import ApiError

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _given(req) -> list[str]:
    """The structured-output fields the request sets (response_format "text" asks nothing)."""
    names = [n for n in (*_GUIDED, "structured_outputs") if getattr(req, n, None) is not None]
    rf = getattr(req, "response_format", None)
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        names.insert(0, "response_format")
    return names


def _response_format(rf) -> StructuredOutputsParams:
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "response_format must be {\"type\": \"text\" | \"json_object\" | "
                            "\"json_schema\", ...}", "response_format")
    if rf["type"] == "json_object":
        return StructuredOutputsParams(json_object=True)
    js = rf.get("json_schema")
    schema = js.get("schema") if isinstance(js, dict) else None
    if not isinstance(schema, dict) or not isinstance(js.get("name", ""), str):
        raise ApiError(400, "response_format of type json_schema needs \"json_schema\": "
                            "{\"name\": ..., \"schema\": {a JSON schema}}", "response_format")
    return StructuredOutputsParams(json=schema)


def _structured_outputs(d) -> StructuredOutputsParams:
    if not isinstance(d, dict):
        raise ValueError("structured_outputs must be an object with one of "
                         f"{', '.join(_SO_KEYS)}")
    extra = sorted(set(d) - set(_SO_KEYS))
    if extra:       # vLLM's other options (whitespace_pattern, ...): refused, never ignored
        raise ValueError(f"structured_outputs.{extra[0]} is not supported by kvflow")
    return StructuredOutputsParams(**d)


def structured_outputs_of(req) -> StructuredOutputsParams | None:
    """The request's structured outputs, or None. ApiError 400 naming the field."""
    names = _given(req)
    if not names:
        return None
    if len(names) > 1:
        raise ApiError(400, f"{names[1]} cannot be combined with {names[0]}: ask for one "
                            f"structured output", names[1])
    name = names[0]
    value = getattr(req, name)
    try:
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            return _structured_outputs(value)
        if name == "guided_json" and not isinstance(value, (dict, str)):
            raise ValueError("guided_json must be a JSON schema (an object or its text)")
        return StructuredOutputsParams(**{_GUIDED[name]: value})
    except ValueError as e:
        msg = str(e)
        if name in _GUIDED:     # the message names the param's own field
            msg = msg.replace(f"structured_outputs.{_GUIDED[name]}", name)
        raise ApiError(400, msg, name) from None


async def check_structured_outputs(llm, req, sp: SamplingParams) -> None:
    """Have the engine core compile the grammar (its cache keeps it for the request): a 400
    naming the request's field if it cannot."""
    so = sp.structured_outputs
    if so is None:
        return
    try:
        err = await llm.call_utility("check_structured_outputs", so)
    except EngineDeadError as e:
        raise ApiError(503, str(e), None, type="server_error") from None
    if err:
        name = _given(req)[0]
        field = next(k for k in _SO_KEYS if getattr(so, k) not in (None, False))
        where = {"response_format": "response_format.json_schema.schema" if field == "json"
                 else name, "structured_outputs": f"structured_outputs.{field}"}.get(name, name)
        raise ApiError(400, err.replace(f"structured_outputs.{field}", where, 1), name)
