"""The outputs of a run, as observers of its stream loop.

The loop (`alma_jax.stream.run`) tells its observers what happens through the
small interface of `base.Observer`: the run starts or resumes, an epoch
ends, the records of a time step are made, the step is over, the stream
ends, a signal stops it. Each output is one observer in one module:

  clock.py         the time breakdown, elapsed time and compiled programs
  records.py       config.json and log.jsonl (per seed)
  events.py        TensorBoard event files
  architecture.py  architecture.jsonl
  checkpoints.py   stream checkpoints (asynchronous) and the stage saves
  progress.py      a progress line per stage
  summary.py       summary.json and error.png
"""
