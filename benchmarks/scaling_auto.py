"""The scaling curve's `auto:DRAFT` rows: what `generate -M auto --layer-split auto --draft DRAFT`
chooses by itself on the emulated hosts, with no profile and no --threads given, one `generate` per
prompt of the set, read back as the records of one run."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from benchmarks.emulated import Cluster, on_host
from benchmarks.runner import JobRun, log, pipeinfer, run_json


def auto_cmd(a, n_hosts: int, cfg: dict, prompt) -> list[str]:
    """`generate -M auto --layer-split auto` for one prompt of the set: no --profile, no --threads."""
    cmd = pipeinfer("generate", a.model, "-M", "auto", "--layer-split", "auto", "--ranks", n_hosts, "--draft", cfg["draft"],
                    "-n", a.n_predict, "--temp", 0, "--json", program=a.pipeinfer)
    if prompt is None:
        return cmd + ["--chat", "PROMPT"]
    return cmd + (["-p", prompt.prompt] if prompt.prompt is not None else ["--messages", "-"])


def run_auto(a, c: Cluster, n_hosts: int, cfg: dict):
    """The row of an `auto:DRAFT` config: one `generate` per prompt of the set, read back as the
    records of one run (the job's own choice in each record's `auto`). A job that calibrates first
    (the first of its cluster) is slower to start; its wall time is kept."""
    from pipeinfer_cli.bench.prompts import load_prompts

    records, wall = [], 0.0
    for p in load_prompts(a.prompts, a.limit):
        cmd = auto_cmd(a, n_hosts, cfg, p)
        with tempfile.NamedTemporaryFile("w", suffix=".json", dir=a.work_dir, delete=False) as f:
            json.dump(list(p.messages or []), f)
        if p.messages is not None:
            cmd[-1] = f.name
        job = run_json(on_host(c, 0, cmd) if n_hosts == 1 else cmd, None, c.env())
        Path(f.name).unlink(missing_ok=True)
        wall += job.wall_s
        if not job.ok:
            return JobRun(job.returncode, wall, None, job.error, job.output, job.stderr)
        records.append({**job.doc, "prompt_id": p.id})
        log(f"  {p.id}: {job.doc.get('auto', {}).get('mode')} "
            f"(layer split {job.doc.get('auto', {}).get('layer_split')}, threads {job.doc.get('auto', {}).get('threads')})")
    return JobRun(0, wall, {"records": records}, None, "")
