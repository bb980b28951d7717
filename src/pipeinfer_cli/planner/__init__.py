"""Planning and prediction without running: a job's plan (its mode, settings, ranks, layers and
threads), calibration profiles, a cost model, a simulated pipeline in virtual time that runs the real
decoding policies, and the layer split and mode that the profile says are fastest. Importing it
starts no MPI."""
