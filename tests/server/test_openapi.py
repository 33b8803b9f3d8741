"""forkd_server/openapi.json (kept in the repo by hand) matches the handlers."""

from __future__ import annotations

import json
import re

from forkd_server.handlers import OPENAPI_PATH, NotFoundHandler, route_table

VERBS = ("get", "post", "put", "patch", "delete")
JSON_TYPES = {"string": "string", "integer": "integer", "number": "number", "boolean": "boolean",
              "string[]": "array", "string[][]": "array", "env": "object", "labels": "object"}


def load() -> dict:
    with open(OPENAPI_PATH) as f:
        return json.load(f)


def resolve(doc: dict, ref: str) -> dict:
    node = doc
    for part in ref.lstrip("#/").split("/"):
        node = node[part]
    return node


def handler_ops() -> dict[tuple[str, str], type]:
    """(openapi path, verb) -> handler, from the route table."""
    ops = {}
    for pattern, handler in route_table(""):
        if handler is NotFoundHandler:
            continue
        path = pattern.replace("/?", "").replace(r"\.", ".")
        param = "{tag}" if path.startswith("/v1/snapshots/") else \
            "{name}" if path.startswith("/v1/workspaces/") else \
            "{ref}" if path.startswith("/v1/store/") else "{id}"
        path = path.replace("([^/]+)", param)
        assert not re.search(r"[()\[\]*+?\\]", path), f"untranslated pattern {pattern}"
        for verb in VERBS:
            if verb in vars(handler):
                ops[(path, verb)] = handler
    return ops


def test_paths_and_methods_match_the_handlers():
    doc = load()
    documented = {(path, verb) for path, item in doc["paths"].items() for verb in item}
    assert documented == set(handler_ops())


def test_request_bodies_match_the_handlers():
    doc = load()
    for (path, verb), handler in handler_ops().items():
        op = doc["paths"][path][verb]
        content = op.get("requestBody", {}).get("content", {})
        if verb in ("post", "put", "patch") and handler.body_spec is not None:
            schema = content["application/json"]["schema"]
            spec = handler.body_spec
            assert set(schema["properties"]) == set(spec), path
            assert set(schema.get("required", [])) == {k for k, (_, req, *_) in spec.items() if req}, path
            for name, (kind, _, *bounds) in spec.items():
                prop = schema["properties"][name]
                if "$ref" in prop:
                    prop = resolve(doc, prop["$ref"])
                if kind == "mib":  # MiB, or "host": all of the host's memory
                    options = prop["anyOf"]
                    assert {"const": "host"} in options and {"type": "null"} in options, (path, name)
                    prop, kind = next(o for o in options if o.get("type") == "integer"), "integer"
                types = prop["type"] if isinstance(prop["type"], list) else [prop["type"]]
                assert JSON_TYPES[kind] in types and set(types) <= {JSON_TYPES[kind], "null"}, (path, name)
                for keyword, value in (bounds[0] if bounds else {}).items():  # the wire's range is stated
                    assert prop.get(keyword) == value, (path, name, keyword)
                if kind == "integer":
                    assert prop.get("minimum", -1) >= 0, (path, name)  # integers on the wire are >= 0
        else:
            assert "application/json" not in content, f"{verb} {path} documents a JSON body it does not take"


def test_path_parameters_are_declared():
    doc = load()
    for path, item in doc["paths"].items():
        names = set(re.findall(r"{(\w+)}", path))
        for verb, op in item.items():
            declared = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert declared == names, (verb, path)


def test_auth_is_documented():
    doc = load()
    assert doc["security"] == [{"bearer": []}]
    for path, item in doc["paths"].items():
        for verb, op in item.items():
            if path == "/healthz":
                assert op["security"] == []
            else:
                assert "401" in op["responses"], (verb, path)
                assert "security" not in op


def test_refs_resolve():
    doc = load()
    text = json.dumps(doc)
    for ref in set(re.findall(r'"\$ref": "#/([^"]+)"', text)):
        node = doc
        for part in ref.split("/"):
            node = node[part]


def test_every_answer_a_route_can_give_is_documented():
    """What admission, the body limit and a full disk add: 413 on bodies, 429/503 on long calls, 409
    on the sandbox's lane, 410 on a sandbox's routes, 507 wherever the registry is written."""
    doc = load()
    for (path, verb), handler in handler_ops().items():
        responses = doc["paths"][path][verb]["responses"]
        if path in ("/healthz", "/version", "/metrics", "/v1/openapi.json", "/v1/events"):
            continue
        assert "507" in responses and "500" in responses, (verb, path)
        if getattr(handler, "body_spec", None) is not None and verb in ("post", "put", "patch"):
            assert "413" in responses, (verb, path)
        if path.startswith("/v1/sandboxes/{id}/") and path != "/v1/sandboxes/{id}/session":
            assert "410" in responses, (verb, path)


def test_405_lists_the_allowed_methods():
    from forkd_server.handlers import SandboxHandler, SnapshotsHandler
    assert SandboxHandler.allowed_methods() == ["GET", "PATCH", "DELETE"]
    assert SnapshotsHandler.allowed_methods() == ["GET", "POST"]
