"""`pipeinfer serve`'s HTTP side: an OpenAI-compatible API over `runtime.service.Service`.

- `openai_errors.py`: the error JSON and status of every refusal;
- `openai_request.py`: request bodies → `GenerationRequest` (every field checked, named on error);
- `openai_response.py`: results → OpenAI objects and stream chunks, with `timings`;
- `metrics.py`: the Prometheus metrics; `app.py`: the routes; `http_thread.py`: uvicorn in a thread.

Imports go one way: cli → server → engine. The engine knows nothing of HTTP.
"""
