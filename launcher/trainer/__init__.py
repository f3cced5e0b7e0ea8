"""The bundled 4D-parallel trainer: `python -m launcher.trainer --plan plan.json --run-dir DIR`.

One file per concern: config (the Plan as this launch runs it), model, mesh, tensor_parallel,
context_parallel, pipeline, fsdp, recompute, loss, engine (the loop); data, checkpoint and
metrics are the I/O around it. This package imports torch; nothing outside it does at import.
"""
