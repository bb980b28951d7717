"""The decoding policies and what they use: modes, sessions, sampling, drafters, trees, KV slots.

Pure decisions: they talk to a pipeline through `pipeline_protocol.PipelineLike` and import no MPI,
so they run against the real pipeline (runtime/) or a simulated one."""
