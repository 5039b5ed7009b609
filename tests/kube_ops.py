"""The pure parts of the fake Kubernetes API (``tests/kube_api.py``): its error, label and
field selectors, and the patch types (RFC 7386 merge, strategic merge for the lists pods
use, RFC 6902 JSON patch)."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]

PATCH_JSON = "application/json-patch+json"
PATCH_MERGE = "application/merge-patch+json"
PATCH_STRATEGIC = "application/strategic-merge-patch+json"
PATCH_APPLY = "application/apply-patch+yaml"


class KubeError(Exception):
    """A failure the API answers with a ``Status`` object of this code and reason."""

    def __init__(self, code: int, reason: str, message: str, details: Obj | None = None):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details or {}

    def status(self) -> Obj:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": self.details,
            "code": self.code,
        }


def bad_request(why: str) -> KubeError:
    return KubeError(400, "BadRequest", why)


# -- selectors ---------------------------------------------------------------------------


Requirement = Callable[[dict[str, str]], bool]

_SET_RE = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\((.*)\)\s*$")
_EQ_RE = re.compile(r"^\s*([^\s!=]+)\s*(==|=|!=)\s*([^\s,]*)\s*$")
_EXISTS_RE = re.compile(r"^\s*(!?)\s*([^\s!=(),]+)\s*$")


def _split_requirements(text: str) -> list[str]:
    """Split at the commas outside parentheses (``a in (x,y),b``)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


def _requirement(text: str) -> Requirement:
    if m := _SET_RE.match(text):
        key, op, values = m[1], m[2], {v.strip() for v in m[3].split(",") if v.strip()}
        if op == "in":
            return lambda labels: labels.get(key) in values
        # notin, as != below, matches an object without the label.
        return lambda labels: labels.get(key) not in values
    if m := _EQ_RE.match(text):
        key, op, value = m[1], m[2], m[3]
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    if m := _EXISTS_RE.match(text):
        negated, key = m[1] == "!", m[2]
        return lambda labels: (key in labels) != negated
    raise bad_request(f"unable to parse requirement: {text!r}")


#: Field selectors the fake knows, and where each reads in an object.
FIELDS: dict[str, tuple[str, ...]] = {
    "metadata.name": ("metadata", "name"),
    "metadata.namespace": ("metadata", "namespace"),
    "status.phase": ("status", "phase"),
    "spec.nodeName": ("spec", "nodeName"),
}


def _fields_of(obj: Obj) -> dict[str, str]:
    found: dict[str, str] = {}
    for field, path in FIELDS.items():
        value: Any = obj
        for step in path:
            value = value.get(step) if isinstance(value, dict) else None
        found[field] = "" if value is None else str(value)
    return found


@dataclass(frozen=True)
class Selector:
    """A ``labelSelector`` and a ``fieldSelector``, as their query strings; empty: all."""

    labels: str = ""
    fields: str = ""

    def compile(self) -> Callable[[Obj], bool]:
        label_reqs = [_requirement(r) for r in _split_requirements(self.labels)]
        field_reqs = []
        for text in _split_requirements(self.fields):
            m = _EQ_RE.match(text)
            if m is None or m[1] not in FIELDS:
                raise bad_request(f'field label not supported: "{text.strip()}"')
            field_reqs.append(_requirement(text))

        def matches(obj: Obj) -> bool:
            labels = obj.get("metadata", {}).get("labels") or {}
            fields = _fields_of(obj)
            return all(r(labels) for r in label_reqs) and all(r(fields) for r in field_reqs)

        return matches


#: No selector: every object.
EVERYTHING = Selector()


# -- patches -----------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, ``null`` removes a key, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


#: Lists merged item by item in a strategic merge patch, and the key that names an item
#: (the first one present in the patch's items). Other lists are replaced, as in a merge
#: patch. Kubernetes reads these from its Go types; these are the ones pods use.
MERGE_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "volumes": ("name",),
    "env": ("name",),
    "volumeMounts": ("mountPath",),
    "ports": ("containerPort", "port"),
    "conditions": ("type",),
    "containerStatuses": ("name",),
    "initContainerStatuses": ("name",),
    "imagePullSecrets": ("name",),
    "podIPs": ("ip",),
}


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """A merge patch whose lists in :data:`MERGE_KEYS` merge by their key; an item with
    ``$patch: delete`` removes its match."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        current = result.get(key)
        if value is None:
            result.pop(key, None)
        elif key in MERGE_KEYS and isinstance(value, list) and isinstance(current, list):
            result[key] = _merge_list(current, value, MERGE_KEYS[key])
        else:
            result[key] = strategic_merge_patch(current, value)
    return result


def _merge_list(current: list[Any], patch: list[Any], keys: tuple[str, ...]) -> list[Any]:
    items = [i for i in patch if isinstance(i, dict)]
    key = next((k for k in keys if items and all(k in i for i in items)), None)
    if key is None or len(items) != len(patch):
        return copy.deepcopy(patch)
    merged = list(current)
    for item in items:
        at = next(
            (n for n, c in enumerate(merged) if isinstance(c, dict) and c.get(key) == item[key]),
            None,
        )
        if item.get("$patch") == "delete":
            if at is not None:
                del merged[at]
        elif at is None:
            merged.append(strategic_merge_patch({}, item))
        else:
            merged[at] = strategic_merge_patch(merged[at], item)
    return merged


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise bad_request(f"JSON pointer must start with '/': {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, path: str) -> tuple[Any, str]:
    steps = _pointer(path)
    if not steps:
        raise bad_request("JSON patch on the whole document is not supported")
    node = doc
    for step in steps[:-1]:
        try:
            node = node[int(step)] if isinstance(node, list) else node[step]
        except (KeyError, IndexError, ValueError, TypeError):
            raise bad_request(f"JSON patch path not found: {path}") from None
    return node, steps[-1]


def _get(doc: Any, path: str) -> Any:
    node, last = _parent(doc, path)
    try:
        return node[int(last)] if isinstance(node, list) else node[last]
    except (KeyError, IndexError, ValueError, TypeError):
        raise bad_request(f"JSON patch path not found: {path}") from None


def _add(doc: Any, path: str, value: Any) -> None:
    node, last = _parent(doc, path)
    if isinstance(node, list):
        node.insert(len(node) if last == "-" else int(last), value)
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise bad_request(f"JSON patch path not found: {path}")


def _remove(doc: Any, path: str) -> Any:
    value = _get(doc, path)
    node, last = _parent(doc, path)
    if isinstance(node, list):
        del node[int(last)]
    else:
        del node[last]
    return value


def json_patch(target: Obj, ops: Any) -> Obj:
    """RFC 6902: add, remove, replace, move, copy, test (a failed test is 422)."""
    if not isinstance(ops, list):
        raise bad_request("a JSON patch is a list of operations")
    doc = copy.deepcopy(target)
    for op in ops:
        name, path = op.get("op"), op.get("path", "")
        if name == "add":
            _add(doc, path, copy.deepcopy(op.get("value")))
        elif name == "remove":
            _remove(doc, path)
        elif name == "replace":
            _get(doc, path)
            _remove(doc, path)
            _add(doc, path, copy.deepcopy(op.get("value")))
        elif name == "move":
            _add(doc, path, _remove(doc, op.get("from", "")))
        elif name == "copy":
            _add(doc, path, copy.deepcopy(_get(doc, op.get("from", ""))))
        elif name == "test":
            if _get(doc, path) != op.get("value"):
                raise KubeError(422, "Invalid", f"the test of JSON patch path {path} failed")
        else:
            raise bad_request(f"unknown JSON patch operation: {name!r}")
    return doc


def apply_patch(patch_type: str, target: Obj, patch: Any) -> Obj:
    if patch_type == PATCH_JSON:
        return json_patch(target, patch)
    if patch_type == PATCH_MERGE:
        return dict(merge_patch(target, patch))
    if patch_type in (PATCH_STRATEGIC, PATCH_APPLY):
        return dict(strategic_merge_patch(target, patch))
    raise KubeError(415, "UnsupportedMediaType", f"the patch type {patch_type!r} is unsupported")
