"""The generation engine: topology, sampling, drafting, the head's decoding loops and the stage workers."""
