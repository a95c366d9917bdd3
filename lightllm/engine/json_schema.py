"""A JSON schema's structure checked without xgrammar: keywords that hold schemas hold schemas,
`type` names JSON types, `required` lists names, and every `$ref` is a local JSON pointer
("#" or "#/...") that resolves inside the schema.

xgrammar reads a `$ref` to a remote URL as no constraint at all, so a schema that refers to
one would leave the output unconstrained; none is fetched, it is refused. The check is a walk
over the schema (no grammar is compiled), cheap enough for every tool of every request.
"""

from __future__ import annotations

from urllib.parse import unquote

TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
# keyword -> how it holds schemas: one, a list of them, or a mapping of names to them
ONE = ("additionalProperties", "additionalItems", "not", "if", "then", "else", "contains", "propertyNames",
       "unevaluatedProperties", "unevaluatedItems", "contentSchema")
LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class SchemaError(ValueError):
    """A schema that cannot constrain an output; the message names where (a path in the schema)."""


def check_json_schema(schema) -> None:
    """Raise SchemaError unless `schema` is a well-formed schema whose references are all local and resolve."""
    if not isinstance(schema, dict):
        raise SchemaError(f"a JSON schema should be an object, got {type(schema).__name__}")
    stack = [(schema, "")]  # a stack, not recursion: a schema may nest deeper than Python's stack
    while stack:
        node, path = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise SchemaError(f"{where(path)} is not a schema (an object or a boolean)")
        _check_keywords(node, path, schema)
        stack.extend(_subschemas(node, path))


def where(path: str) -> str:
    return f"the schema at {path!r}" if path else "the schema"


def _check_keywords(node: dict, path: str, root: dict) -> None:
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is not None and (not kinds or not all(isinstance(k, str) and k in TYPES for k in kinds)):
        raise SchemaError(f"{where(path)}: 'type' {kind!r} is not a JSON type ({', '.join(sorted(TYPES))}) "
                          "or a list of them")
    required = node.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise SchemaError(f"{where(path)}: 'required' is a list of property names")
    if "enum" in node and not isinstance(node["enum"], list):
        raise SchemaError(f"{where(path)}: 'enum' is a list")
    if "$ref" in node:
        _resolve(node["$ref"], path, root)


def _resolve(ref, path: str, root: dict) -> None:
    """A local JSON pointer (RFC 6901, as a URI fragment) must name a part of the schema."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise SchemaError(f"{where(path)}: '$ref' {ref!r} is not a local reference ('#/...'); only references "
                          "inside the schema are supported, none is fetched")
    if ref != "#" and not ref.startswith("#/"):
        raise SchemaError(f"{where(path)}: '$ref' {ref!r} is not a JSON pointer ('#/...')")
    target = root
    for part in ref[2:].split("/") if ref != "#" else ():
        key = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and key in target:
            target = target[key]
        elif isinstance(target, list) and key.isdigit() and int(key) < len(target):
            target = target[int(key)]
        else:
            raise SchemaError(f"{where(path)}: '$ref' {ref!r} names nothing in the schema")


def _subschemas(node: dict, path: str) -> list[tuple[object, str]]:
    found = [(node[key], f"{path}/{key}") for key in ONE if key in node]
    items = node.get("items")
    if isinstance(items, list):  # the older tuple form
        found += [(s, f"{path}/items/{i}") for i, s in enumerate(items)]
    elif items is not None:
        found.append((items, f"{path}/items"))
    for key in LISTS:
        if key in node:
            if not isinstance(node[key], list) or (key != "prefixItems" and not node[key]):
                raise SchemaError(f"{where(path)}: '{key}' is a non-empty list of schemas")
            found += [(s, f"{path}/{key}/{i}") for i, s in enumerate(node[key])]
    for key in MAPS:
        if key in node:
            if not isinstance(node[key], dict):
                raise SchemaError(f"{where(path)}: '{key}' maps names to schemas")
            found += [(s, f"{path}/{key}/{name}") for name, s in node[key].items()]
    return found
