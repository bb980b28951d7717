"""Machine-readable benchmark output.

JSON (`--json`): one object
    {"schema": "pipeinfer-bench/1",
     "header": {versions, models (with sha256), topology, threads, host, config, command, …},
     "summary": {mode: per-mode statistics (bench/stats.py)},
     "tokens_identical": bool, "token_mismatches": [...],
     "records": [one per (prompt, mode, repeat) in run order, warmups included with "warmup": true]}
Each record carries the metric fields of docs/json-output.md (n_prompt, n_gen, ttft_s, tok_per_s,
decode_tok_per_s, itl_ms, acceptance, runs, drafting, ranks) plus text and token ids. Trace events are not
repeated here: they go to `--trace`.

CSV (`--csv`): the same records flat, one row each, nested fields joined with dots
(`itl_ms.p50`, `acceptance.rate`, `rank1.busy_s`, `rank0.cpu_split.own_s`). The header is written first as comment lines
`# key: value` (dotted keys, values as JSON) — read it with `pandas.read_csv(path, comment="#")`
or skip lines starting with `#`. Text and token ids are left out of the CSV (see the JSON);
`tokens_sha1` identifies the token sequence, so equal tokens have equal hashes.
"""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

SCHEMA = "pipeinfer-bench/1"
METRIC_FIELDS = ("n_prompt", "n_gen", "ttft_s", "tok_per_s", "decode_tok_per_s", "itl_ms", "acceptance", "runs", "drafting")
RANK_FIELDS = ("role", "threads", "peak_rss_mib", "busy_s", "cpu_s")
EMPTY_ITL = {"mean": None, "p50": None, "p90": None}


def strip_trace(record: dict) -> dict:
    """A copy of the record without the per-rank trace events (they are large; see --trace)."""
    out = dict(record)
    out["ranks"] = [{k: v for k, v in r.items() if k != "trace"} for r in record["ranks"]]
    return out


def bench_document(header: dict, summary: dict, mismatches: list[dict], records: list[dict]) -> dict:
    return {"schema": SCHEMA, "header": header, "summary": summary, "tokens_identical": not mismatches,
            "token_mismatches": mismatches, "records": [strip_trace(r) for r in records]}


def write_json(path: Path, doc: dict) -> None:
    path.write_text(json.dumps(doc, indent=1) + "\n")


def _flatten(obj, prefix: str, out: dict) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = obj


def _flatten_wire(wire: dict, row: dict) -> None:
    """Per link bytes/messages per token, the head's return bytes, waiting and hand-off times."""
    for link in wire.get("links", []):
        p = f"wire.{link['from']}->{link['to']}"
        row[f"{p}.bytes_per_token"] = link["bytes_per_token"]
        row[f"{p}.messages_per_token"] = link["messages_per_token"]
    for k in ("head_received_bytes_per_token", "head_received_bytes_per_row"):
        row[f"wire.{k}"] = wire.get(k)
    for rank, s in (wire.get("wait_s") or {}).items():
        row[f"wire.wait_s.rank{rank}"] = s
    for link, h in (wire.get("handoff_ms") or {}).items():
        row[f"wire.handoff_ms.{link}.p50"] = h["p50"]


def tokens_sha1(tokens: list[int]) -> str:
    return hashlib.sha1(" ".join(map(str, tokens)).encode()).hexdigest()[:16]


def flat_record(rec: dict) -> dict:
    row: dict = {}
    for k in ("index", "prompt_id", "mode", "repeat", "warmup", "model", "draft", "layer_split", "n_ctx"):
        row[k] = rec.get(k)
    for k in METRIC_FIELDS:
        v = rec.get(k)
        _flatten(EMPTY_ITL if k == "itl_ms" and v is None else v, k, row)  # same columns for 1-token records
    _flatten_wire(rec.get("wire") or {}, row)
    row["tokens_match"] = rec.get("tokens_match")
    row["reference_mode"] = rec.get("reference_mode")
    row["tokens_sha1"] = tokens_sha1(rec["tokens"])
    for r in rec["ranks"]:
        p = f"rank{r['rank']}"
        row[f"{p}.layers"] = "-".join(map(str, r["layers"])) if r.get("layers") else ""
        for k in RANK_FIELDS:
            row[f"{p}.{k}"] = r.get(k)
        for k, v in (r.get("cpu_split") or {}).items():
            row[f"{p}.cpu_split.{k}"] = v
    return row


def write_csv(path: Path, header: dict, records: list[dict]) -> None:
    rows = [flat_record(r) for r in records]
    columns: list[str] = []
    for row in rows:  # union of keys, first-seen order (itl_ms may be None for 1-token records)
        columns += [k for k in row if k not in columns]
    flat_header: dict = {}
    _flatten(header, "", flat_header)
    with open(path, "w", newline="") as f:
        f.write(f"# schema: {json.dumps(SCHEMA)}\n")
        for k, v in flat_header.items():
            f.write(f"# {k}: {json.dumps(v)}\n")
        w = csv.DictWriter(f, fieldnames=columns, restval="", lineterminator="\n")
        w.writeheader()
        for row in rows:
            w.writerow({k: "" if v is None else v for k, v in row.items()})
