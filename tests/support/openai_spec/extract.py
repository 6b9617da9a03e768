"""Write an extract of OpenAI's OpenAPI document: the component schemas reachable from the
roots named, with descriptions, examples and `x-oaiMeta` removed (they validate nothing).

    git -C openai-openapi show f85dbe2:openapi.json > /tmp/openapi.json
    python tests/support/openai_spec/extract.py /tmp/openapi.json OUT.json ROOT [ROOT ...]

`openai-openapi-responses-extract.json` is this, for the Responses API's roots
(`RESPONSES_ROOTS`), from github.com/openai/openai-openapi at commit f85dbe2 (MIT: LICENSE
beside this file)."""

import json
import sys
from typing import Any

RESPONSES_ROOTS = ("Response", "ResponseStreamEvent", "ErrorResponse")
SOURCE = "github.com/openai/openai-openapi openapi.json, commit f85dbe2 (API version 2.3.0)"


def _strip(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            k: _strip(v)
            for k, v in node.items()
            if k != "x-oaiMeta" and not (k in ("description", "example") and isinstance(v, str))
        }
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def _refs(node: Any):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                yield v.rsplit("/", 1)[-1]
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def extract(document: dict[str, Any], roots: list[str]) -> dict[str, Any]:
    schemas = document["components"]["schemas"]
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_refs(schemas[name]))
    return {
        "x-source": f"{SOURCE}, components.schemas reachable from {', '.join(roots)}; "
        "descriptions removed. MIT licence: LICENSE beside this file.",
        "openapi": document["openapi"],
        "components": {"schemas": {k: _strip(schemas[k]) for k in sorted(seen)}},
    }


if __name__ == "__main__":
    source, out, *names = sys.argv[1:]
    with open(source) as f:
        document = json.load(f)
    with open(out, "w") as f:
        json.dump(extract(document, names or list(RESPONSES_ROOTS)), f, separators=(",", ":"))
