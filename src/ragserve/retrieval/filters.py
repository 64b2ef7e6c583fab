"""Metadata filters: `{key: value}` (equality), `{key: [v1, v2]}` (in), `{key: {"gte": a,
"lte": b}}` (range; also `gt`, `lt`), all keys and-ed. A list-valued field (e.g. `tags`)
matches when any of its elements does.

`validate_filter` checks the shape once at the edge; `filter_sql` compiles it for the document
store (SQLite JSON functions).
"""

from __future__ import annotations

from typing import Any

RANGE_OPS = {"gte": ">=", "gt": ">", "lte": "<=", "lt": "<"}
Filter = dict[str, Any]
_SCALARS = (str, int, float, bool)


def validate_filter(flt: Any) -> Filter | None:
    """The filter, checked; `None` or `{}` → `None`. Raises `ValueError` naming the bad key."""
    if flt is None:
        return None
    if not isinstance(flt, dict):
        raise ValueError(f"filter must be an object of metadata key -> condition, got {flt!r}")
    for key, cond in flt.items():
        if not isinstance(key, str) or not key or '"' in key or "\\" in key:
            raise ValueError(f"filter key must be a non-empty string without quotes: {key!r}")
        if isinstance(cond, dict):
            bad = set(cond) - set(RANGE_OPS)
            if not cond or bad:
                raise ValueError(f"filter[{key!r}]: range needs gte/gt/lte/lt, got {sorted(cond)}")
            kinds = {isinstance(v, str) for v in cond.values()}
            if not all(isinstance(v, _SCALARS) for v in cond.values()) or len(kinds) > 1:
                raise ValueError(f"filter[{key!r}]: range bounds must be all strings or numbers")
        elif isinstance(cond, list):
            if not cond or not all(isinstance(v, _SCALARS) for v in cond):
                raise ValueError(f"filter[{key!r}]: 'in' needs a non-empty list of values")
        elif not isinstance(cond, _SCALARS):
            raise ValueError(f"filter[{key!r}]: value must be a string, number, list or range")
    return dict(flt) or None


def filter_sql(flt: Filter) -> tuple[str, list[Any]]:
    """A WHERE clause over `docs.metadata` and its arguments."""
    clauses, args = [], []
    for key, cond in flt.items():
        each = f"SELECT 1 FROM json_each(docs.metadata, '$.\"{key}\"') WHERE "
        if isinstance(cond, dict):  # text bounds compare text, numbers numbers
            kinds = "'text'" if isinstance(next(iter(cond.values())), str) else "'integer','real'"
            each += f"type IN ({kinds}) AND "
            each += " AND ".join(f"value {RANGE_OPS[op]} ?" for op in cond)
            args += list(cond.values())
        elif isinstance(cond, list):
            each += f"value IN ({','.join('?' * len(cond))})"
            args += cond
        else:
            each += "value = ?"
            args.append(cond)
        clauses.append(f"EXISTS ({each})")
    return " AND ".join(clauses) or "1", args
