"""The forecast: how long a job takes and what it costs, from a pilot of the job itself on the
machine at hand. It sits above generation and training (its pilot runs their jobs); they know
nothing of it and read what it leaves beside their output as plain data (``workbook.recorded_forecast``).

Where each part lives:
- ``pilot``: the pilot (a generation job's own batches, spread across its prompt lengths; a training
  run's steps drawn across its epochs) and the whole forecast assembled from what it measured;
- ``model``: the job simulated from the pilot's timings (static batches, training steps), its range,
  the cost and the projection to every profile, and what `workbook forecast` records (``Forecast``);
- ``stream``: the same for a streaming job (the ``continuous`` backend): its scheduler simulated step by step;
- ``training_steps``: the training pilot's steps (drawn across the run), its run in a fresh process,
  and the step model that prices every step of the run by what it holds (tokens, attention pairs);
- ``eta``: the job's ETA plan by the forecast's model, left beside the output for the job's progress;
- ``startup``: the job's start-up and exit, timed in a fresh process;
- ``regression`` / ``forward_timer``: the nonnegative least squares and the forward hooks the pilot times with;
- ``command``: `workbook forecast` (pilot, print, record).
"""
