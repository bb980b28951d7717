"""`pipeinfer bench`: run the decoding modes side by side on the same ranks and report how they compare.

One concern per module: `prompts` (load and validate a prompt set), `schedule` (the interleaved
request order), `runner` (run the job, check token equality), `stats` (per-mode summary),
`environment` (versions, model checksum, host facts), `report` (the rich table), `export` (JSON
and CSV), `chrome_trace` (Perfetto timeline) and `plot` (PNG); under load (`--concurrency`),
`server_job` (the `pipeinfer serve` job) and `concurrency` (the requests, their statistics and text check).
"""
