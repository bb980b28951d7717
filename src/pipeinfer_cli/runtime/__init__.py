"""The processes of a job: planning and loading, the head and its MPI client of the pipeline, the
stages, the draft rank, the fault protocol, and the service that feeds requests to the head."""
