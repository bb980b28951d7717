"""The liveness defaults (see liveness.py), in a module that does not start MPI when imported, so that
the CLI can show them in --help before any job runs."""

# A rank that sends nothing, or computes without finishing a layer, for this long ends the job.
# One layer of one eval must finish within it: a 256-token prompt chunk through one layer of a 70B
# model is about 0.45 TFLOP, 5-20 s on a slow CPU node; 60 s leaves room for a loaded one.
DEFAULT_RANK_TIMEOUT_S = 60.0
# calibrate's: a rank that measures is silent until its figures settle; on a host held to half a
# CPU a quick calibration's rank took over 60 s (4 emulated hosts, 0.5 CPU each).
CALIBRATE_RANK_TIMEOUT_S = 600.0
BEAT_MAX_INTERVAL_S = 5.0  # heartbeats every min(timeout / 4, this) seconds
